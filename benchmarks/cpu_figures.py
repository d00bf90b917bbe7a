"""CPU figures: vocab counting over 20M tokens, and `snakemake -n` with 1,000 shards.

* counting: ``count_supervised_tokens`` over ~20M random completion ids in 40,000 samples
  of 100-1,000 tokens, target vocabulary 163,840 (Kimi-K2.5's), best of 3;
* dry-run: ``snakemake -n -q`` of the embedded default with ``prompts.num_shards: 1000``
  (2,000 shard jobs) in an empty working directory, best of 3 wall-clock runs, next to the
  same with 1 shard (start-up cost).

Prints JSON with the figures, the goals (2 s, 3 s) and the command. Each figure is a phase:
``--out`` is rewritten after each, a failed one is recorded with its error (a failed
``snakemake -n`` with its log under ``--work``) and the script exits 1 at the end.

Run (CPU, after ``make setup``)::

    .venv/bin/python benchmarks/cpu_figures.py --out benchmarks/results/cpu_figures.json
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow_scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import phases  # noqa: E402

from eagle3_pipeline.vocab import count_supervised_tokens  # noqa: E402


def counting(vocab: int = 163_840, samples: int = 40_000) -> dict:
    rng = np.random.default_rng(0)
    lists = [rng.integers(0, vocab, size=int(n)).tolist() for n in rng.integers(100, 1000, size=samples)]
    tokens = sum(len(x) for x in lists)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        count_supervised_tokens(lists, vocab)
        best = min(best, time.perf_counter() - t)
    return {"tokens": tokens, "samples": samples, "vocab": vocab, "seconds": round(best, 3), "goal_seconds": 2.0}


#: Seconds one ``snakemake -n`` may take before it is stopped (the goal is 3).
DRY_RUN_TIMEOUT = 600


def dry_run(shards: int, work: Path) -> float:
    """Best of 3 wall-clock seconds of ``snakemake -n -q`` of the embedded default with ``shards`` prompt shards.

    Raises:
        phases.PhaseError: a run failed (its log under ``work``).
    """
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "c.yaml"
        cfg.write_text(yaml.safe_dump({"prompts": {"num_shards": shards, "sources": [{"type": "builtin_sharegpt"}], "max_prompts": None}}))
        cmd = [
            sys.executable,
            "-m",
            "snakemake",
            "-n",
            "-q",
            "--cores",
            "4",
            "--configfile",
            str(cfg),
            "-d",
            str(Path(d) / "wd"),
            "-s",
            str(ROOT / "Snakefile"),
        ]
        best = float("inf")
        for i in range(3):
            t = time.perf_counter()
            run = phases.run_phase(cmd, work / f"dry-run-{shards}-shards-{i}.log", timeout=DRY_RUN_TIMEOUT, cwd=ROOT)
            if not run.ok:
                raise phases.PhaseError(f"snakemake -n with {shards} shards: {run.error}", run.log)
            best = min(best, time.perf_counter() - t)
    return round(best, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "cpu_figures"), help="the dry runs' logs")
    args = ap.parse_args()
    phases.fail_fast(phases.missing_packages(["snakemake"]))
    work = Path(args.work)
    results = phases.Results(args.out, {"command": "python benchmarks/cpu_figures.py " + " ".join(sys.argv[1:])})
    results.inline("vocab_counting", counting, section=None)
    results.inline(
        "dry_run",
        lambda: {"shards_1_seconds": dry_run(1, work), "shards_1000_seconds": dry_run(1000, work), "goal_seconds": 3.0},
        section=None,
    )
    print(json.dumps(results.data, indent=2))
    sys.exit(results.finish())


if __name__ == "__main__":
    main()
