"""The run layout: every path under ``results/<run>/`` and ``logs/<run>/``, in one object.

``layout = RunLayout(run)`` names each file a run writes; the rules declare their inputs, outputs,
logs and benchmarks from it (``output: traces=layout.traces("{shard}")``), and plan, lineage,
resume, training, evaluation, sweeps and the scripts ask it for the same paths, so a path is
spelled once. A sweep variant's files have the same sub-layout under ``sweep/<variant>/``:
``layout.variant(name)`` is a :class:`RunLayout` rooted there (its logs under
``logs/<run>/sweep/<variant>/``, its benchmarks under ``logs/<run>/benchmarks/sweep/<variant>/``).

Paths are strings, joined with ``/`` exactly as Snakemake matches them (``results/e2e/vocab/d2t.npy``);
a wildcard is passed through as its pattern (``layout.traces("{shard}")``). Nothing here touches
the disk.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

#: Where the embedded default target is materialized (rule prepare_target_model; shared by all runs).
BUILTIN_TARGET_DIR = "resources/models/smollm2-135m-instruct"
#: Name of a training's checkpoint folder beside its metrics (:class:`eagle3_pipeline.training.TrainCheckpoint`).
CHECKPOINT_DIR = ".checkpoint"
#: Name of the run's process records folder (:class:`eagle3_pipeline.hygiene.ProcessRecord`).
PIDS_DIR = ".pids"


def shard_ids(num_shards: int) -> list[str]:
    """The run's shard ids (the ``{shard}`` wildcard's values): ``00000`` .. ``num_shards - 1``,
    zero-padded to five digits, for ``prompts.num_shards`` shards."""
    return [f"{i:05d}" for i in range(num_shards)]


def shard_name(shard: str) -> str:
    """``shard-<shard>``: the stem of every per-shard file (``shard`` is ``NNNNN`` or a wildcard pattern)."""
    return f"shard-{shard}"


def index_beside(shard_path: str | os.PathLike) -> Path:
    """The ``.index.json`` beside a hidden-state shard (``shard-00000.safetensors`` → ``shard-00000.index.json``)."""
    p = Path(shard_path)
    return p.with_name(p.name.replace(".safetensors", ".index.json"))


#: The prompt set's summary file in ``prompts/`` (:meth:`RunLayout.prompt_summary`).
PROMPT_SUMMARY = "summary.json"


def prompt_summary_beside(prompt_shard: str | os.PathLike) -> tuple[Path, int]:
    """The prompt set's summary (:meth:`RunLayout.prompt_summary`) beside one of its shards, and the
    shard's position in the summary's ``shards`` counts (``prompts/shard-00003.jsonl`` →
    ``(prompts/summary.json, 3)``)."""
    p = Path(prompt_shard)
    return p.with_name(PROMPT_SUMMARY), int(p.stem.removeprefix(shard_name("")))


def summary_beside(traces_path: str | os.PathLike) -> Path:
    """The ``.summary.json`` beside a trace shard (``shard-00000.jsonl`` → ``shard-00000.summary.json``)."""
    p = Path(traces_path)
    return p.with_name(p.name.replace(".jsonl", ".summary.json"))


def rejects_beside(traces_path: str | os.PathLike) -> Path:
    """The ``.rejects.jsonl`` beside a trace shard (``shard-00000.jsonl`` → ``shard-00000.rejects.jsonl``)."""
    p = Path(traces_path)
    return p.with_name(p.name.replace(".jsonl", ".rejects.jsonl"))


def checkpoint_beside(train_metrics_path: str | os.PathLike) -> Path:
    """The training checkpoint folder (:meth:`RunLayout.train_checkpoint`) beside a training's
    ``metrics.jsonl`` (``train/metrics.jsonl`` → ``train/.checkpoint``), which is what the training
    job's library code is handed."""
    return Path(train_metrics_path).with_name(CHECKPOINT_DIR)


def pids_of(shard_output: str | os.PathLike) -> Path:
    """The run's process records folder (:meth:`RunLayout.pids`) for one output of a per-shard job
    (``results/<run>/<stage>/shard-NNNNN.*``), which is all a shard job's library code is handed."""
    return Path(shard_output).parents[1] / PIDS_DIR


class RunLayout:
    """The files of run ``run``: results under ``<results>/<run>/``, logs under ``<logs>/<run>/``.

    Args:
        run: the config's ``run``.
        results, logs: the folders that hold every run's results and logs (relative to the
            working directory, as the rules name them).
    """

    def __init__(self, run: str, results: str | os.PathLike = "results", logs: str | os.PathLike = "logs"):
        self.run = run
        #: ``results/<run>``: every file of the run below.
        self.dir = f"{Path(results).as_posix()}/{run}"
        #: ``logs/<run>``: each job's log.
        self.log_dir = f"{Path(logs).as_posix()}/{run}"
        #: ``logs/<run>/benchmarks``: Snakemake's per-job benchmark files (the rules' ``benchmark:``).
        self.bench_dir = f"{self.log_dir}/benchmarks"
        #: The run's process records, shared by its variants (:meth:`pids`).
        self._pids = f"{self.dir}/{PIDS_DIR}"

    @classmethod
    def at(cls, run_dir: str | os.PathLike, bench_dir: str | os.PathLike | None = None) -> RunLayout:
        """The layout of an existing run directory ``run_dir`` (any folder; its name is the run's):
        logs under ``logs/<name>/`` as for :class:`RunLayout` (``name``), benchmarks in ``bench_dir``
        when given. For readers handed a run directory (plans, summaries, lineage, tests)."""
        p = Path(run_dir)
        lay = cls(p.name)
        lay.dir = p.as_posix()
        lay._pids = f"{lay.dir}/{PIDS_DIR}"
        if bench_dir is not None:
            lay.bench_dir = Path(bench_dir).as_posix()
        return lay

    def of_job(self, wildcards: dict) -> RunLayout:
        """The layout a job with ``wildcards`` writes into: its sweep variant's (:meth:`variant`) where
        they name one (``{"variant": v}``), else this run's."""
        return self.variant(wildcards["variant"]) if wildcards.get("variant") else self

    def variant(self, name: str) -> RunLayout:
        """The layout of sweep variant ``name`` (or the ``"{variant}"`` wildcard): the same files under
        ``results/<run>/sweep/<name>/``, logs under ``logs/<run>/sweep/<name>/``, benchmarks under
        ``logs/<run>/benchmarks/sweep/<name>/``. Written by rules/sweep.smk; its process records are the run's."""
        lay = RunLayout.__new__(RunLayout)
        lay.run = self.run
        lay.dir = f"{self.dir}/sweep/{name}"
        lay.log_dir = f"{self.log_dir}/sweep/{name}"
        lay.bench_dir = f"{self.bench_dir}/sweep/{name}"
        lay._pids = self._pids
        return lay

    def __repr__(self) -> str:
        return f"RunLayout(dir={self.dir!r}, log_dir={self.log_dir!r}, bench_dir={self.bench_dir!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunLayout) and repr(self) == repr(other)

    def __hash__(self) -> int:
        return hash(repr(self))

    def relative(self, path: str | os.PathLike) -> str:
        """``path`` relative to the run directory (the run manifest's artifact keys), or ``path`` itself
        when it lies outside."""
        try:
            return Path(path).relative_to(self.dir).as_posix()
        except ValueError:
            return str(path)

    # ------------------------------------------------------------------ prompts

    def prompt_shard(self, shard: str) -> str:
        """``prompts/shard-NNNNN.jsonl``: canonical prompt records of one shard. Written by
        prepare_prompts; read by generate_traces."""
        return f"{self.dir}/prompts/{shard_name(shard)}.jsonl"

    def prompt_rejects(self) -> str:
        """``prompts/rejects.jsonl``: every dropped prompt record with its reason. Written by prepare_prompts."""
        return f"{self.dir}/prompts/rejects.jsonl"

    def prompt_summary(self) -> str:
        """``prompts/summary.json``: prompt counts and rejects by reason. Written by prepare_prompts;
        read by summarize_run and the plan (its prompt count)."""
        return f"{self.dir}/prompts/{PROMPT_SUMMARY}"

    def eval_prompts(self) -> str:
        """``eval/prompts.jsonl``: the held-out evaluation questions. Written by prepare_eval_prompts;
        read by evaluate_drafter (and its variants) and benchmarks/drafter_gap.py."""
        return f"{self.dir}/eval/prompts.jsonl"

    # ------------------------------------------------------------------ traces

    def traces(self, shard: str) -> str:
        """``traces/shard-NNNNN.jsonl``: the target's answers to one prompt shard. Written by
        generate_traces; read by build_vocab_mapping, extract_hidden_states, plot_run and verify."""
        return f"{self.dir}/traces/{shard_name(shard)}.jsonl"

    def trace_rejects(self, shard: str) -> str:
        """``traces/shard-NNNNN.rejects.jsonl``: answers generation rejected, with reasons. Written by generate_traces."""
        return rejects_beside(self.traces(shard)).as_posix()

    def trace_summary(self, shard: str) -> str:
        """``traces/shard-NNNNN.summary.json``: counts, timings and the traces' SHA-256 of one shard.
        Written by generate_traces; read by summarize_run, the plan (measured throughput) and verify."""
        return summary_beside(self.traces(shard)).as_posix()

    # ------------------------------------------------------------------ vocab

    def vocab_dir(self) -> str:
        """``vocab/``: the draft vocabulary's folder (the files below). Read by training as one folder."""
        return f"{self.dir}/vocab"

    def vocab(self, name: str) -> str:
        """``vocab/<name>.npy`` for ``d2t``, ``t2d`` or ``token_freq``: the draft vocabulary (speculators
        semantics) and the supervised-token counts. Written by build_vocab_mapping; read by
        train_drafter (d2t, t2d), plot_run (token_freq) and the manifest's checks."""
        return f"{self.vocab_dir()}/{name}.npy"

    def coverage(self) -> str:
        """``vocab/coverage.json``: coverage of the chosen and other draft vocab sizes. Written by
        build_vocab_mapping; read by summarize_run, plot_run and sweep_table."""
        return f"{self.vocab_dir()}/coverage.json"

    # ------------------------------------------------------------------ hidden states

    def hidden_states(self, shard: str) -> str:
        """``hidden_states/shard-NNNNN.safetensors``: prefill hidden states, loss mask and offsets of one
        shard. Written by extract_hidden_states; read by train_drafter and verify."""
        return f"{self.dir}/hidden_states/{shard_name(shard)}.safetensors"

    def hidden_index(self, shard: str) -> str:
        """``hidden_states/shard-NNNNN.index.json``: the shard's sample index, SHA-256 and timings.
        Written by extract_hidden_states; read by summarize_run, the plan, lineage and verify."""
        return index_beside(self.hidden_states(shard)).as_posix()

    # ------------------------------------------------------------------ training

    def drafter(self) -> str:
        """``drafter/``: the speculators-format EAGLE-3 checkpoint. Written by train_drafter; read by
        evaluate_drafter, the manifest and vLLM."""
        return f"{self.dir}/drafter"

    def train_metrics(self) -> str:
        """``train/metrics.jsonl``: loss and accuracy per step, validation per epoch. Written by
        train_drafter; read by plot_run."""
        return f"{self.dir}/train/metrics.jsonl"

    def train_summary(self) -> str:
        """``train/summary.json``: the training's totals and timings. Written by train_drafter; read by
        evaluate_drafter, summarize_run, sweep_table and the plan."""
        return f"{self.dir}/train/summary.json"

    def train_checkpoint(self) -> str:
        """``train/.checkpoint/``: the interrupted training's state (``progress.json``, weights,
        optimizer). Written and removed by train_drafter (:class:`eagle3_pipeline.training.TrainCheckpoint`);
        read by the plan and the resume hint."""
        return checkpoint_beside(self.train_metrics()).as_posix()

    # ------------------------------------------------------------------ evaluation

    def acceptance(self) -> str:
        """``eval/acceptance.json``: τ and per-position acceptance from vLLM, the speedup. Written by
        evaluate_drafter; read by summarize_run, plot_run, sweep_table and the plan."""
        return f"{self.dir}/eval/acceptance.json"

    def eval_outputs(self) -> str:
        """``eval/outputs.jsonl``: the evaluation's answers. Written by evaluate_drafter."""
        return f"{self.dir}/eval/outputs.jsonl"

    def eval_rejects(self) -> str:
        """``eval/rejects.jsonl``: evaluation prompts without room for their answer. Written by evaluate_drafter."""
        return f"{self.dir}/eval/rejects.jsonl"

    # ------------------------------------------------------------------ the run as a whole

    def summary(self) -> str:
        """``summary.json``: the run in one file. Written by summarize_run; read by plot_run."""
        return f"{self.dir}/summary.json"

    def plot(self, name: str) -> str:
        """``plots/<name>.png``: one of the report's figures. Written by plot_run; read by ``snakemake --report``."""
        return f"{self.dir}/plots/{name}.png"

    def manifest(self) -> str:
        """``manifest.json``: the run's lineage. Written by write_manifest; read by verify."""
        return f"{self.dir}/manifest.json"

    def sweep_json(self) -> str:
        """``sweep.json``: τ and training cost of the run's drafter and every variant's. Written by sweep_table."""
        return f"{self.dir}/sweep.json"

    def sweep_table(self) -> str:
        """``sweep.md``: the same as a Markdown table. Written by sweep_table."""
        return f"{self.dir}/sweep.md"

    def plan_preview(self) -> str:
        """``plan.json``: the latest ``snakemake plan`` preview. Written by rule plan."""
        return f"{self.dir}/plan.json"

    def plans_dir(self) -> str:
        """``plans/``: the plan each run start or resume made (:meth:`start_plan`)."""
        return f"{self.dir}/plans"

    def start_plan(self, now: datetime | None = None) -> str:
        """``plans/start-<UTC time>.json`` (``YYYYmmddTHHMMSS.ffffffZ``; names sort in time order and each
        run start has its own): the plan a run starts with. Written by the onstart hook; read by
        summarize_run (estimate vs actual)."""
        now = now or datetime.now(UTC)
        return f"{self.plans_dir()}/start-{now.astimezone(UTC):%Y%m%dT%H%M%S.%fZ}.json"

    def start_plans(self) -> list[Path]:
        """The start plans the run keeps (:meth:`start_plan`), oldest first (reads the disk)."""
        return sorted(Path(self.plans_dir()).glob("start-*.json"))

    def pids(self) -> str:
        """``.pids/``: the process records of the run's engines (generation, extraction, evaluation; a
        variant's too), so that a rerun stops those a killed job left. Written by those jobs
        (:class:`eagle3_pipeline.hygiene.ProcessRecord`); read by ``cleanup_stale_processes``."""
        return self._pids

    # ------------------------------------------------------------------ logs and benchmarks

    def log(self, rule: str, shard: str | None = None) -> str:
        """``logs/<run>/<rule>.log``, or ``logs/<run>/<rule>/shard-NNNNN.log`` for a per-shard rule's job:
        the job's log, written by its script (stderr first). Read by users and the resume hint."""
        return f"{self.log_dir}/{rule}.log" if shard is None else f"{self.log_dir}/{rule}/{shard_name(shard)}.log"

    def benchmark(self, rule: str, shard: str | None = None) -> str:
        """``logs/<run>/benchmarks/<rule>.tsv``, or ``<rule>/shard-NNNNN.tsv`` per shard: the job's wall
        time and memory. Written by Snakemake (the rule's ``benchmark:``); read by summarize_run
        (estimate vs actual)."""
        return f"{self.bench_dir}/{rule}.tsv" if shard is None else f"{self.bench_dir}/{rule}/{shard_name(shard)}.tsv"

    # ------------------------------------------------------------------ shared by every run

    @staticmethod
    def target_model_log() -> str:
        """``logs/prepare_target_model.log``: the materialization of the embedded target (run-independent)."""
        return "logs/prepare_target_model.log"

    @staticmethod
    def target_model_benchmark() -> str:
        """``logs/prepare_target_model.benchmark.tsv``: its wall time and memory (run-independent)."""
        return "logs/prepare_target_model.benchmark.tsv"
