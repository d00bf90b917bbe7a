"""CPU figures: vocab counting over 20M tokens, and `snakemake -n` with 1,000 shards.

* counting: ``count_supervised_tokens`` over ~20M random completion ids in 40,000 samples
  of 100-1,000 tokens, target vocabulary 163,840 (Kimi-K2.5's), best of 3;
* dry-run: ``snakemake -n -q`` of the embedded default with ``prompts.num_shards: 1000``
  (2,000 shard jobs) in an empty working directory, best of 3 wall-clock runs, next to the
  same with 1 shard (start-up cost).

Prints JSON with the figures, the goals (2 s, 3 s) and the command.

    python benchmarks/cpu_figures.py --out benchmarks/results/cpu_figures.json
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow_scripts"))

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


def dry_run(shards: int) -> float:
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
        for _ in range(3):
            t = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
            best = min(best, time.perf_counter() - t)
    return round(best, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    res = {
        "command": "python benchmarks/cpu_figures.py " + " ".join(sys.argv[1:]),
        "vocab_counting": counting(),
        "dry_run": {"shards_1_seconds": dry_run(1), "shards_1000_seconds": dry_run(1000), "goal_seconds": 3.0},
    }
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
