"""Multi-GPU benchmark: the workflow's own stage functions on 1 vs 2 GPUs, side by side.

Target: a Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 query / 8 KV heads,
MLP 8192) with random bf16 weights and the embedded target's tokenizer (vocab 49,152),
so tensor parallel 2 divides its heads. Prompts: a prompts shard of the workflow (real
ShareGPT first turns). Each measurement runs in a fresh process (GPU memory released):

* generation (``run_generation_shard``, vLLM, greedy, ``max_tokens`` 256): 1 GPU;
  tensor parallel 2; data parallel 2 (two engine replicas sharing the chunks);
* extraction (``run_extraction_shard``, hf backend): 1 replica vs 2 replicas, 1 GPU each;
* training (``run_training``): 1 GPU with 2 accumulated packs per step vs DDP on 2 GPUs
  (1 pack each per step, the same packs) vs FSDP on 2 GPUs.

Prints one JSON document (figures, comparisons, and the command that reproduces it)
and writes it to ``--out``/multi_gpu.json.

    python benchmarks/multi_gpu.py all --config-dir <SmolLM2 config+tokenizer dir> \\
        --prompts <prompts shard.jsonl> --work /root/work --out $OUT
    (or the phases one by one: --phase generate, then --phase rest)
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow_scripts"))

SHAPE = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def make_target(config_dir: str, work: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target = work / "target"
    if (target / "config.json").is_file():
        return target
    cfg = AutoConfig.from_pretrained(config_dir)
    for k, v in SHAPE.items():
        setattr(cfg, k, v)
    cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tmp = work / "target.tmp"
    model.save_pretrained(tmp)
    tok = AutoTokenizer.from_pretrained(config_dir)
    tok.save_pretrained(tmp)
    tmp.rename(target)
    return target


def _cfg(section: str, values: dict) -> dict:
    from eagle3_pipeline.config import validate_config

    return validate_config({section: values})[section]


def run_generate(args) -> dict:
    from eagle3_pipeline.generation import run_generation_shard

    out = Path(args.work) / f"gen-{args.name}"
    out.mkdir(parents=True, exist_ok=True)
    params = {
        "generation": _cfg("generation", {"temperature": 0.0, "max_tokens": 256, "chunk_prompts": 64}),
        "vllm": _cfg(
            "vllm",
            {
                "tensor_parallel_size": args.tp,
                "data_parallel_size": args.dp,
                "enforce_eager": True,
                "gpu_memory_utilization": 0.8,
            },
        ),
        "seed": 0,
        "max_seq_len": 2048,
        "trust_remote_code": False,
    }
    t = time.perf_counter()
    s = run_generation_shard(
        args.prompts,
        {k: str(out / f"traces.{k}.jsonl") if k != "summary" else str(out / "summary.json") for k in ("traces", "rejects", "summary")},
        str(Path(args.work) / "target"),
        params,
        chunk_prompts=64,
    )
    return s | {"job_seconds": time.perf_counter() - t}


def run_extract(args) -> dict:
    from eagle3_pipeline.hidden_states import run_extraction_shard

    out = Path(args.work) / f"hs-{args.name}"
    out.mkdir(parents=True, exist_ok=True)
    cfg = _cfg("extraction", {"chunk_samples": 64, "batch_tokens": 16384, "device": "cuda"})
    t = time.perf_counter()
    idx = run_extraction_shard(
        args.traces or str(Path(args.work) / "gen-dp1-tp1" / "traces.traces.jsonl"),
        str(out / "shard-00000.safetensors"),
        str(out / "shard-00000.index.json"),
        str(Path(args.work) / "target"),
        {**cfg, "data_parallel_size": args.dp, "gpus_per_replica": 1},
        max_seq_len=2048,
        trust_remote_code=False,
    )
    return {k: v for k, v in idx.items() if k != "samples"} | {"job_seconds": time.perf_counter() - t}


def run_vocab(args) -> dict:
    import numpy as np

    from eagle3_pipeline.io import read_jsonl, save_npy_atomic
    from eagle3_pipeline.vocab import build_mapping

    counts = np.zeros(49152, dtype=np.int64)
    for t in read_jsonl(Path(args.work) / "gen-dp1-tp1" / "traces.traces.jsonl"):
        np.add.at(counts, np.asarray(t["completion_token_ids"]), 1)
    d2t, t2d = build_mapping(counts, 8192)
    save_npy_atomic(Path(args.work) / "vocab" / "d2t.npy", d2t)
    save_npy_atomic(Path(args.work) / "vocab" / "t2d.npy", t2d)
    return {"distinct_tokens": int((counts > 0).sum())}


def run_train(args) -> dict:
    from eagle3_pipeline.training import run_training

    out = Path(args.work) / f"train-{args.name}"
    cfg = _cfg(
        "training",
        {
            "epochs": 1,
            "pack_tokens": 4096,
            "val_fraction": 0.0,
            "log_every_steps": 5,
            "checkpoint_every_steps": 0,
            "device": "cuda",
            "parallelism": args.parallelism,
            "gradient_accumulation_steps": args.accum,
        },
    )
    t = time.perf_counter()
    s = run_training(
        {
            "shards": [str(Path(args.work) / "hs-dp1" / "shard-00000.safetensors")],
            "vocab_dir": str(Path(args.work) / "vocab"),
            "target_path": str(Path(args.work) / "target"),
            "out_dir": str(out / "drafter"),
            "metrics_path": str(out / "metrics.jsonl"),
            "cfg": cfg,
            "seed": 0,
            "max_seq_len": 2048,
        },
        args.procs,
    )
    return s | {"job_seconds": time.perf_counter() - t}


def _sub(work: Path, gpus: str, *argv: str) -> dict:
    """Run one measurement in a fresh process on ``gpus``; its JSON result."""
    res = work / ("result-" + "-".join(a.replace("/", "_") for a in argv) + ".json")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
    cmd = [sys.executable, __file__, "one", argv[0], "--work", str(work), "--result", str(res), *argv[1:]]
    print(f"$ CUDA_VISIBLE_DEVICES={gpus} {' '.join(cmd)}", flush=True)
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        return {"error": f"exit code {rc}"}
    return json.loads(res.read_text())


def _traces(work: Path, name: str) -> dict:
    from eagle3_pipeline.io import read_jsonl

    return {t["id"]: t["completion_token_ids"] for t in read_jsonl(work / f"gen-{name}" / "traces.traces.jsonl")}


def _same_completions(a: dict, b: dict) -> dict:
    same = sum(a[k] == b.get(k) for k in a)
    prefix = []
    for k in a:
        x, y = a[k], b.get(k, [])
        n = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
        prefix.append(n / max(len(x), 1))
    return {"identical": same, "of": len(a), "mean_common_prefix_fraction": sum(prefix) / len(prefix)}


def _weights_diff(work: Path, a: str, b: str) -> dict:
    from safetensors.torch import load_file

    wa = load_file(str(work / f"train-{a}" / "drafter" / "model.safetensors"))
    wb = load_file(str(work / f"train-{b}" / "drafter" / "model.safetensors"))
    diffs = {k: (wa[k].float() - wb[k].float()).abs().max().item() for k in wa}
    scale = {k: wa[k].float().abs().max().item() for k in wa}
    worst = max(diffs, key=lambda k: diffs[k] / max(scale[k], 1e-12))
    return {"max_abs_diff": max(diffs.values()), "worst_tensor": worst, "worst_rel_to_max": diffs[worst] / max(scale[worst], 1e-12)}


def _random_traces(path: Path, prompts: str | None, config_dir: str, n: int = 300) -> None:
    """Traces with random completions of 50-256 tokens; prompts rendered from ``prompts`` if given, else random."""
    import numpy as np

    from eagle3_pipeline.generation import render_prompt_ids
    from eagle3_pipeline.io import read_jsonl
    from eagle3_pipeline.target_model import load_tokenizer

    rng = np.random.default_rng(0)
    tok = load_tokenizer(config_dir, False)
    recs = sorted(read_jsonl(prompts), key=lambda r: r["id"])[:n] if prompts else [None] * n
    with open(path, "w") as f:
        for i, rec in enumerate(recs):
            p = render_prompt_ids(tok, rec["messages"])[:1700] if rec else rng.integers(10, 49152, size=int(rng.integers(30, 600))).tolist()
            c = rng.integers(10, 49152, size=int(rng.integers(50, 257))).tolist()
            f.write(json.dumps({"id": f"{i:016x}", "prompt_token_ids": p, "completion_token_ids": c}) + "\n")


def _shard_diff(work: Path, a: str, b: str) -> dict:
    from eagle3_pipeline.shards import read_shard

    sa, ha, *_ = read_shard(work / f"hs-{a}" / "shard-00000.safetensors")
    sb, hb, *_ = read_shard(work / f"hs-{b}" / "shard-00000.safetensors")
    assert [x.id for x in sa] == [x.id for x in sb]
    equal = sum(bool((x == y).all()) for x, y in zip(ha, hb, strict=True))
    worst = max(float((x.float() - y.float()).abs().max()) for x, y in zip(ha, hb, strict=True))
    return {"samples_bit_equal": equal, "of": len(sa), "max_abs_diff": worst}


def extraction_check(args, work: Path) -> dict:
    """Is hf extraction run-to-run deterministic on one GPU, and do 2 replicas match 1?"""
    make_target(args.config_dir, work)
    traces = work / "random-traces.jsonl"
    _random_traces(traces, args.prompts, args.config_dir)
    out = {}
    for name, gpus, extra in (("a", "0", []), ("b", "0", []), ("gpu1", "1", []), ("dp2", "0,1", ["--dp", "2"])):
        r = _sub(work, gpus, "extract", "--name", name, "--traces", str(traces), *extra)
        out[name] = {k: r.get(k) for k in ("num_tokens", "tokens_per_second", "model_load_seconds", "sha256", "error")}
    out["a_vs_b_same_gpu"] = _shard_diff(work, "a", "b")
    out["a_vs_gpu1"] = _shard_diff(work, "a", "gpu1")
    out["a_vs_dp2"] = _shard_diff(work, "a", "dp2")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["all", "one"])
    ap.add_argument("--phase", choices=["all", "generate", "rest", "extract-check"], default="all")
    ap.add_argument("--config-dir")
    ap.add_argument("--prompts")
    ap.add_argument("--work", required=True)
    ap.add_argument("--out")
    ap.add_argument("--result")
    ap.add_argument("stage", nargs="?")
    ap.add_argument("--name", default="")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--parallelism", default="ddp")
    ap.add_argument("--traces")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.mode == "one":
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        args.prompts = args.prompts or str(work / "prompts.jsonl")
        fn = {"generate": run_generate, "extract": run_extract, "vocab": run_vocab, "train": run_train}[args.stage]
        Path(args.result).write_text(json.dumps(fn(args), default=str))
        return

    import torch

    res_path = work / "multi_gpu.json"
    res = json.loads(res_path.read_text()) if res_path.is_file() else {}
    res |= {
        "device": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}",
        "torch": torch.__version__,
        "target": "Llama-3.2-1B-shaped (hidden 2048, 16 layers, 32/8 heads), random bf16 weights, SmolLM2 tokenizer (vocab 49,152)",
    }
    res.setdefault("commands", []).append("python benchmarks/multi_gpu.py " + " ".join(sys.argv[1:]))
    if args.phase in ("all", "generate"):
        import shutil

        shutil.copy(args.prompts, work / "prompts.jsonl")
        make_target(args.config_dir, work)
        import vllm

        res["vllm"] = vllm.__version__
        gen = res.setdefault("generation", {})
        gen["1gpu"] = _sub(work, "0", "generate", "--name", "dp1-tp1")
        gen["tp2"] = _sub(work, "0,1", "generate", "--name", "dp1-tp2", "--tp", "2")
        gen["dp2"] = _sub(work, "0,1", "generate", "--name", "dp2-tp1", "--dp", "2")
        ref = _traces(work, "dp1-tp1")
        gen["dp2_vs_1gpu"] = _same_completions(ref, _traces(work, "dp2-tp1"))
        gen["tp2_vs_1gpu"] = _same_completions(ref, _traces(work, "dp1-tp2"))
        for k in ("tp2", "dp2"):
            if "completion_tokens_per_second" in gen[k] and "completion_tokens_per_second" in gen["1gpu"]:
                gen[f"{k}_speedup"] = gen[k]["completion_tokens_per_second"] / gen["1gpu"]["completion_tokens_per_second"]
    if args.phase in ("all", "rest"):
        ext = res.setdefault("extraction", {})
        ext["1gpu"] = _sub(work, "0", "extract", "--name", "dp1")
        ext["dp2"] = _sub(work, "0,1", "extract", "--name", "dp2", "--dp", "2")
        ext["dp2_bit_equal_to_1gpu"] = ext["dp2"].get("sha256") == ext["1gpu"].get("sha256")
        if ext["1gpu"].get("tokens_per_second"):
            ext["dp2_speedup"] = ext["dp2"].get("tokens_per_second", 0) / ext["1gpu"]["tokens_per_second"]
        res["vocab"] = _sub(work, "0", "vocab")
        tr = res.setdefault("training", {})
        tr["1gpu_accum2"] = _sub(work, "0", "train", "--name", "one", "--accum", "2")
        tr["ddp2"] = _sub(work, "0,1", "train", "--name", "ddp", "--procs", "2")
        tr["fsdp2"] = _sub(work, "0,1", "train", "--name", "fsdp", "--procs", "2", "--parallelism", "fsdp")
        for k in ("ddp2", "fsdp2"):
            if "error" not in tr[k] and "error" not in tr["1gpu_accum2"]:
                tr[f"{k}_vs_1gpu_weights"] = _weights_diff(work, "one", {"ddp2": "ddp", "fsdp2": "fsdp"}[k])
                tr[f"{k}_speedup"] = tr[k]["tokens_per_second"] / tr["1gpu_accum2"]["tokens_per_second"]
    if args.phase == "extract-check":
        res["extraction_check"] = extraction_check(args, work)
    text = json.dumps(res, indent=2, default=str)
    res_path.write_text(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "multi_gpu.json").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
