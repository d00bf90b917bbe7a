"""CPU figures: vocab counting over 20M tokens, and `snakemake -n` with 1,000 shards.

* counting: ``count_supervised_tokens`` over ~20M random completion ids in 40,000 samples
  of 100-1,000 tokens, target vocabulary 163,840 (Kimi-K2.5's), best of 3;
* dry-run: ``snakemake -n -q`` of the embedded default with ``prompts.num_shards: 1000``
  (2,000 shard jobs) in an empty working directory, best of 5 wall-clock runs, next to the
  same with 1 shard (start-up cost) and to a bare workflow of the same 2,000 script jobs and
  nothing else (``BARE_SNAKEFILE``: what Snakemake itself spends on them); the three take
  turns, round after round.

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
#: Wall-clock runs of each ``snakemake -n``; the figure is the fastest.
DRY_RUN_REPEATS = 5

#: The floor under the 1,000-shard figure: a workflow of nothing but two per-shard rules, the
#: second reading the first's output, each with the directives of the shard rules
#: (generate_traces, extract_hidden_states): an output, a log, a benchmark, resources, params
#: and a ``script:``. Its ``snakemake -n`` is Snakemake's own cost for the same 2,000 jobs.
BARE_SNAKEFILE = """\
SHARDS = [f"{i:05d}" for i in range(int(config["shards"]))]


rule all:
    input:
        expand("results/b/shard-{shard}.out", shard=SHARDS),


rule a:
    output:
        "results/a/shard-{shard}.out",
    log:
        "logs/a/shard-{shard}.log",
    benchmark:
        "logs/benchmarks/a/shard-{shard}.tsv"
    resources:
        gpu=1,
    params:
        settings={"seed": 0, "layers": [2, 15, 27]},
    script:
        "job.py"


rule b:
    input:
        "results/a/shard-{shard}.out",
    output:
        "results/b/shard-{shard}.out",
    log:
        "logs/b/shard-{shard}.log",
    benchmark:
        "logs/benchmarks/b/shard-{shard}.tsv"
    resources:
        gpu=1,
    params:
        settings={"seed": 0, "layers": [2, 15, 27]},
    script:
        "job.py"
"""


def dry_runs(work: Path) -> dict:
    """Best of :data:`DRY_RUN_REPEATS` wall-clock seconds of ``snakemake -n -q``, each in an empty
    working directory: the embedded default with 1 and 1,000 prompt shards, and
    :data:`BARE_SNAKEFILE` with 1,000. The three take turns, round after round, so that a slow
    spell of a shared machine falls on each of them alike.

    Raises:
        phases.PhaseError: a run failed (its log under ``work``).
    """
    with tempfile.TemporaryDirectory() as d:
        cases = {}  # figure -> (snakefile, config)
        for shards in (1, 1000):
            cfg = Path(d) / f"shards-{shards}" / "c.yaml"
            cfg.parent.mkdir()
            cfg.write_text(
                yaml.safe_dump({"prompts": {"num_shards": shards, "sources": [{"type": "builtin_sharegpt"}], "max_prompts": None}})
            )
            cases[f"shards_{shards}_seconds"] = (ROOT / "Snakefile", cfg)
        bare = Path(d) / "bare"
        bare.mkdir()
        (bare / "Snakefile").write_text(BARE_SNAKEFILE)
        (bare / "job.py").write_text("")
        (bare / "c.yaml").write_text(yaml.safe_dump({"shards": 1000}))
        cases["bare_shards_1000_seconds"] = (bare / "Snakefile", bare / "c.yaml")
        best = dict.fromkeys(cases, float("inf"))
        for i in range(DRY_RUN_REPEATS):
            for name, (snakefile, cfg) in cases.items():
                cmd = [sys.executable, "-m", "snakemake", "-n", "-q", "--cores", "4", "--configfile", str(cfg)]
                cmd += ["-d", str(cfg.parent / "wd"), "-s", str(snakefile)]
                t = time.perf_counter()
                run = phases.run_phase(cmd, work / f"dry-run-{name.removesuffix('_seconds')}-{i}.log", timeout=DRY_RUN_TIMEOUT, cwd=ROOT)
                if not run.ok:
                    raise phases.PhaseError(f"snakemake -n ({name}): {run.error}", run.log)
                best[name] = min(best[name], time.perf_counter() - t)
    return {name: round(t, 3) for name, t in best.items()}


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
        lambda: {**dry_runs(work), "goal_seconds": 3.0},
        section=None,
    )
    print(json.dumps(results.data, indent=2))
    sys.exit(results.finish())


if __name__ == "__main__":
    main()
