"""GPU smoke benchmark of the library's extraction and training paths (no vLLM needed).

Builds a randomly initialised target with the embedded target's shape (SmolLM2-135M:
30 layers, hidden 576, vocab 49,152) from its config and tokenizer files, makes random
token traces of 256-1024 tokens, then on the GPU: extracts hidden states with the `hf`
backend (checked against an independent transformers forward), builds the draft vocab,
trains the EAGLE-3 drafter with speculators' model (flex attention, fused loss) and
reloads the checkpoint with speculators. Each of these is a phase: ``<out>/gpu_smoke.json``
(tokens/s of each stage) is rewritten after each, a failed one is recorded with its error,
the phases after it are not run, and the script exits 1 at the end.

``--config-dir`` defaults to the embedded target's folder, which Snakemake's rule
prepare_target_model makes first when it is missing (its log in ``<out>``).

Run (GPU host, after ``bash envs/gpu-host-setup.sh <wheelhouse>``)::

    .venv/bin/python benchmarks/gpu_smoke.py --out /tmp/smoke
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow_scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import phases  # noqa: E402


def make_target(args: argparse.Namespace, out: Path, state: dict) -> dict:
    """The random target (saved to ``out/target``) and random samples of 256-1024 tokens."""
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from eagle3_pipeline.conventions import loss_mask
    from eagle3_pipeline.shards import Sample

    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(args.config_dir)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out / "target")
    AutoTokenizer.from_pretrained(args.config_dir).save_pretrained(out / "target")
    rng = np.random.default_rng(0)
    samples = []
    for i in range(args.samples):
        n_p, n_c = int(rng.integers(64, 512)), int(rng.integers(192, 512))
        ids = rng.integers(100, cfg.vocab_size, size=n_p + n_c)
        samples.append(Sample(f"{i:016x}", ids.astype(np.int64), loss_mask(n_p, n_c)))
    state |= {"cfg": cfg, "samples": samples}
    return {"samples": len(samples), "target": str(out / "target")}


def extract(args: argparse.Namespace, out: Path, state: dict) -> dict:
    """``hf`` extraction of the samples, checked against a batch-1 forward, written as one shard."""
    import torch

    from eagle3_pipeline.conventions import resolve_layer_ids
    from eagle3_pipeline.hf_backend import extract_hf, load_hf_target
    from eagle3_pipeline.shards import write_shard

    samples = state["samples"]
    aux, layer_ids = resolve_layer_ids(None, state["cfg"].num_hidden_layers)
    t = time.perf_counter()
    m = load_hf_target(str(out / "target"), "auto")
    res = {"extract_load_s": time.perf_counter() - t}
    torch.cuda.synchronize()
    t = time.perf_counter()
    states = extract_hf(m, samples, layer_ids, batch_tokens=32768, storage_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    secs = time.perf_counter() - t
    tokens = sum(len(s.input_ids) for s in samples)
    res |= {"extract_tokens": tokens, "extract_s": secs, "extract_tok_per_s": tokens / secs}
    with torch.no_grad():
        ref = m(input_ids=torch.from_numpy(samples[0].input_ids)[None].cuda(), output_hidden_states=True).hidden_states
    res["extract_max_abs_diff_vs_batch1_forward"] = [
        float((states[0][:, j].float() - ref[k][0].float().cpu()).abs().max()) for j, k in enumerate(layer_ids[:-1])
    ]
    del m
    torch.cuda.empty_cache()
    shard = out / "hidden_states" / "shard-00000.safetensors"
    write_shard(shard, samples, states, layer_ids=layer_ids, aux_layer_ids=aux, index_path=shard.with_suffix(".index.json"))
    state["shard"] = shard
    return res


def vocab(args: argparse.Namespace, out: Path, state: dict) -> dict:
    """The draft vocab (8,192) of the samples' supervised tokens, in ``out/vocab``."""
    from eagle3_pipeline.io import save_npy_atomic
    from eagle3_pipeline.vocab import build_mapping, count_supervised_tokens

    counts = count_supervised_tokens((s.input_ids[s.loss_mask] for s in state["samples"]), state["cfg"].vocab_size)
    d2t, t2d = build_mapping(counts, 8192)
    save_npy_atomic(out / "vocab" / "d2t.npy", d2t)
    save_npy_atomic(out / "vocab" / "t2d.npy", t2d)
    return {"draft_vocab": len(d2t)}


def train_drafter(args: argparse.Namespace, out: Path, state: dict) -> dict:
    """The drafter trained on the shard: steps, tokens, seconds, tokens/s, device."""
    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.training import train

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
        [str(state["shard"])],
        str(out / "vocab"),
        str(out / "target"),
        str(out / "drafter"),
        str(out / "train.jsonl"),
        tcfg,
        seed=0,
        max_seq_len=2048,
    )
    return {"train_" + k: summary[k] for k in ("steps", "tokens_seen", "seconds", "tokens_per_second", "device")}


def reload(args: argparse.Namespace, out: Path, state: dict) -> dict:
    """The checkpoint loaded back with speculators: its aux layer ids."""
    from speculators.models.eagle3 import Eagle3DraftModel

    d = Eagle3DraftModel.from_pretrained(str(out / "drafter"))
    return {"reloaded_aux_layer_ids": d.config.eagle_aux_hidden_state_layer_ids}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config-dir", help="config.json + tokenizer files of the target's shape (default: the embedded target's)")
    ap.add_argument("--out", required=True, help="the work folder (created); gpu_smoke.json goes there")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--loss-implementation", default="auto", choices=["auto", "eager", "fused"])
    args = ap.parse_args()
    problems = phases.missing_packages(["transformers", "speculators"]) + phases.no_cuda()
    if args.config_dir:
        problems += phases.missing_paths({Path(args.config_dir) / "config.json": "--config-dir needs a config.json and tokenizer files"})
    else:
        problems += phases.embedded_target_problems()
    phases.fail_fast(problems)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    results = phases.Results(
        out / "gpu_smoke.json",
        {"command": " ".join(["python", *sys.argv]), "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "phases": {}},
    )
    if not args.config_dir:
        made = phases.make_embedded_target(results, out / "embedded_target.log")
        if made is None:
            sys.exit(results.finish())
        args.config_dir = str(made)
    state: dict = {}
    for name, fn in (("target", make_target), ("extract", extract), ("vocab", vocab), ("train", train_drafter), ("reload", reload)):
        if results.inline(name, fn, args, out, state) is None:
            break  # each phase needs the one before
    print(json.dumps(results.data, indent=1))
    sys.exit(results.finish())


if __name__ == "__main__":
    main()
