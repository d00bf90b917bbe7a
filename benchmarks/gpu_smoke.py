"""GPU smoke benchmark of the library's extraction and training paths (no vLLM needed).

Builds a randomly initialised target with the embedded target's shape (SmolLM2-135M:
30 layers, hidden 576, vocab 49,152) from its config and tokenizer files, makes random
token traces of 256-1024 tokens, then on the GPU: extracts hidden states with the `hf`
backend (checked against an independent transformers forward), builds the draft vocab,
trains the EAGLE-3 drafter with speculators' model (flex attention, fused loss) and
reloads the checkpoint with speculators. Prints tokens/s of each stage as JSON.

    python benchmarks/gpu_smoke.py --config-dir <dir with config.json + tokenizer files> --out /tmp/smoke
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow_scripts"))

from eagle3_pipeline.config import validate_config  # noqa: E402
from eagle3_pipeline.conventions import loss_mask, resolve_layer_ids  # noqa: E402
from eagle3_pipeline.hf_backend import extract_hf, load_hf_target
from eagle3_pipeline.io import save_npy_atomic  # noqa: E402
from eagle3_pipeline.shards import (
    Sample,
    write_shard,  # noqa: E402
)
from eagle3_pipeline.training import train  # noqa: E402
from eagle3_pipeline.vocab import build_mapping, count_supervised_tokens  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--loss-implementation", default="auto", choices=["auto", "eager", "fused"])
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = Path(args.out)
    target = out / "target"
    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(args.config_dir)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(args.config_dir).save_pretrained(target)

    rng = np.random.default_rng(0)
    samples = []
    for i in range(args.samples):
        n_p, n_c = int(rng.integers(64, 512)), int(rng.integers(192, 512))
        ids = rng.integers(100, cfg.vocab_size, size=n_p + n_c)
        samples.append(Sample(f"{i:016x}", ids.astype(np.int64), loss_mask(n_p, n_c)))
    aux, layer_ids = resolve_layer_ids(None, cfg.num_hidden_layers)
    res: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "samples": len(samples)}

    t = time.perf_counter()
    m = load_hf_target(str(target), "auto")
    res["extract_load_s"] = time.perf_counter() - t
    torch.cuda.synchronize()
    t = time.perf_counter()
    states = extract_hf(m, samples, layer_ids, batch_tokens=32768, storage_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    secs = time.perf_counter() - t
    tokens = sum(len(s.input_ids) for s in samples)
    res |= {"extract_tokens": tokens, "extract_s": secs, "extract_tok_per_s": tokens / secs}
    with torch.no_grad():
        ref = m(input_ids=torch.from_numpy(samples[0].input_ids)[None].cuda(), output_hidden_states=True).hidden_states
    diffs = [float((states[0][:, j].float() - ref[k][0].float().cpu()).abs().max()) for j, k in enumerate(layer_ids[:-1])]
    res["extract_max_abs_diff_vs_batch1_forward"] = diffs
    del m
    torch.cuda.empty_cache()
    shard = out / "hidden_states" / "shard-00000.safetensors"
    write_shard(shard, samples, states, layer_ids=layer_ids, aux_layer_ids=aux, index_path=shard.with_suffix(".index.json"))

    counts = count_supervised_tokens((s.input_ids[s.loss_mask] for s in samples), cfg.vocab_size)
    d2t, t2d = build_mapping(counts, 8192)
    save_npy_atomic(out / "vocab" / "d2t.npy", d2t)
    save_npy_atomic(out / "vocab" / "t2d.npy", t2d)

    tcfg = validate_config(
        {
            "training": {
                "epochs": args.epochs,
                "pack_tokens": 8192,
                "device": "auto",
                "log_every_steps": 5,
                "loss_implementation": args.loss_implementation,
            }
        }
    )["training"]
    summary = train(
        [str(shard)], str(out / "vocab"), str(target), str(out / "drafter"), str(out / "train.jsonl"), tcfg, seed=0, max_seq_len=2048
    )
    res |= {"train_" + k: summary[k] for k in ("steps", "tokens_seen", "seconds", "tokens_per_second", "device")}
    from speculators.models.eagle3 import Eagle3DraftModel

    d = Eagle3DraftModel.from_pretrained(str(out / "drafter"))
    res["reloaded_aux_layer_ids"] = d.config.eagle_aux_hidden_state_layer_ids
    res["command"] = " ".join(["python"] + sys.argv)
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
