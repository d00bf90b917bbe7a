"""fp8 hidden-state storage: bytes, dequantisation error and the effect on training.

From a finished run's traces (default: the embedded demo, ``make run``), extracts the
hidden states twice with the `hf` backend, as bfloat16 and as float8_e4m3fn (per-token,
per-layer scales), then trains the drafter on each with the run's training settings and
seed, and prints (and writes to ``--out``) bytes per token, the dequantisation error per
layer (relative RMS and max, against the bf16 states) and the validation accuracy per
TTT position of both drafters.

The run's traces and vocab and the embedded target are checked first (a missing one named
with the Snakemake command that makes it); each storage dtype is a phase, ``--out`` is
rewritten after each, a failed one is recorded with its error and the script exits 1 at the
end. Finished extractions and trainings under ``--work`` are reused.

Run after the demo run (``make setup``, then ``make run``)::

    .venv/bin/python benchmarks/fp8_effect.py --run default --out benchmarks/results/fp8_effect_cpu.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow_scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import phases  # noqa: E402

from eagle3_pipeline.config import validate_config  # noqa: E402
from eagle3_pipeline.hidden_states import run_extraction_shard  # noqa: E402
from eagle3_pipeline.layout import RunLayout, shard_ids  # noqa: E402
from eagle3_pipeline.shards import ShardReader  # noqa: E402
from eagle3_pipeline.training import train  # noqa: E402


def extract_and_train(cfg: dict, run: Path, target: str, traces: list[Path], work: Path, dtype: str) -> dict:
    """Extract ``traces`` with storage ``dtype`` into ``work/<dtype>`` and train the drafter on them (each
    reused when finished): bytes, tokens, extraction time, final validation and training tokens/s."""
    shards = []
    t = time.perf_counter()
    for tr in traces:
        out = work / dtype / tr.name.replace(".jsonl", ".safetensors")
        out.parent.mkdir(parents=True, exist_ok=True)
        if not out.is_file():
            run_extraction_shard(
                str(tr),
                str(out),
                str(out.with_name(out.name.replace(".safetensors", ".index.json"))),
                target,
                {**cfg["extraction"], "storage_dtype": dtype, "data_parallel_size": 1, "gpus_per_replica": 1},
                max_seq_len=cfg["max_seq_len"],
                trust_remote_code=False,
                host_lock_enabled=False,
            )
        shards.append(str(out))
    idx = [json.loads(Path(s.replace(".safetensors", ".index.json")).read_text()) for s in shards]
    tokens = sum(i["num_tokens"] for i in idx)
    res = {"bytes": sum(i["bytes"] for i in idx), "tokens": tokens, "bytes_per_token": sum(i["bytes"] for i in idx) / tokens}
    res["extract_seconds"] = round(time.perf_counter() - t, 1)
    drafter = work / dtype / "drafter"
    summary_path = work / dtype / "train-summary.json"
    if not summary_path.is_file():
        s = train(
            shards,
            str(run / "vocab"),
            target,
            str(drafter),
            str(work / dtype / "metrics.jsonl"),
            cfg["training"],
            seed=cfg["seed"],
            max_seq_len=cfg["max_seq_len"],
        )
        summary_path.write_text(json.dumps(s))
    s = json.loads(summary_path.read_text())
    return res | {"final_val": s["final_val"], "train_tokens_per_second": s["tokens_per_second"]}


def dequant_error(work: Path) -> dict:
    """Dequantisation error per layer of the fp8 shards against the bf16 ones, over all tokens."""
    a = [ShardReader(p) for p in sorted((work / "bfloat16").glob("shard-*.safetensors"))]
    b = [ShardReader(p) for p in sorted((work / "float8_e4m3fn").glob("shard-*.safetensors"))]
    x = torch.cat([r.all_hidden_states().float() for r in a])
    y = torch.cat([r.all_hidden_states().float() for r in b])
    err = (x - y).pow(2).mean(dim=(0, 2)).sqrt() / x.pow(2).mean(dim=(0, 2)).sqrt()
    return {
        "layer_ids": a[0].layer_ids,
        "relative_rms": [round(float(v), 5) for v in err],
        "max_abs": [round(float(v), 4) for v in (x - y).abs().amax(dim=(0, 2))],
        "max_abs_state": [round(float(v), 2) for v in x.abs().amax(dim=(0, 2))],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default="default")
    ap.add_argument("--config", default=str(ROOT / "config" / "config.yaml"))
    ap.add_argument("--work", default=str(ROOT / "benchmarks" / "fp8_effect"))
    ap.add_argument("--out")
    args = ap.parse_args()
    cfg = validate_config(yaml.safe_load(Path(args.config).read_text()))
    run = ROOT / "results" / args.run
    target = str(phases.embedded_target())
    layout = RunLayout(args.run)
    shards = shard_ids(cfg["prompts"]["num_shards"])
    needed = [
        *(layout.traces(s) for s in shards),
        layout.vocab("d2t"),
        layout.vocab("t2d"),
        str(phases.embedded_target().relative_to(ROOT)),
    ]
    phases.fail_fast(phases.missing_run_outputs(needed, [args.config]))
    traces = sorted((run / "traces").glob("shard-?????.jsonl"))
    work = Path(args.work)
    results = phases.Results(
        args.out, {"run": args.run, "command": "python benchmarks/fp8_effect.py " + " ".join(sys.argv[1:]), "traces": len(traces)}
    )
    for dtype in ("bfloat16", "float8_e4m3fn"):
        results.inline(dtype, extract_and_train, cfg, run, target, traces, work, dtype, section=None)
    if not results.failed:
        results.inline("dequant_error", dequant_error, work, section=None)
        results.data["bytes_ratio_fp8_to_bf16"] = results.data["float8_e4m3fn"]["bytes"] / results.data["bfloat16"]["bytes"]
    print(json.dumps(results.data, indent=2))
    sys.exit(results.finish())


if __name__ == "__main__":
    main()
