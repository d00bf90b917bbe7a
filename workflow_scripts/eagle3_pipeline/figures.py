"""The run's figures for ``snakemake --report``: what each shows, its report category and label
(drawn by :mod:`eagle3_pipeline.report`). A module of its own, free of numpy and matplotlib,
because the Snakefile imports it to make rule plot_run's outputs (every ``snakemake`` call
parses it)."""

from __future__ import annotations

from typing import NamedTuple


class FigureInfo(NamedTuple):
    """A figure of the report: what it shows, its report category and its label there; its
    caption is ``report/<name>.rst``."""

    shows: str
    category: str
    label: str


#: The figures ``make_plots`` writes, by name (rule plot_run's named outputs,
#: ``RunLayout.plot(name)``), in the report's order.
FIGURES = {
    "lengths": FigureInfo("prompt and completion lengths (tokens) of the generated traces", "1. Traces", "prompt and completion lengths"),
    "generation": FigureInfo(
        "generation outcomes (records) and the reasoning capture rate", "1. Traces", "generation outcomes and reasoning capture"
    ),
    "rejects": FigureInfo(
        "rejected records and errors by stage and reason (prompts beyond max_prompts apart)", "1. Traces", "rejected records and errors"
    ),
    "vocab_coverage": FigureInfo(
        "coverage vs draft vocabulary size from vocab/token_freq.npy", "2. Draft vocabulary", "coverage vs draft vocab size"
    ),
    "training_loss": FigureInfo("loss per step, total and per draft position (train and validation)", "3. Training", "loss per step"),
    "training_accuracy": FigureInfo(
        "per-position accuracy per step (train and validation)", "3. Training", "per-position accuracy per step"
    ),
    "acceptance": FigureInfo("acceptance length τ and per-position acceptance in vLLM", "4. Evaluation", "acceptance length in vLLM"),
    "speedup": FigureInfo(
        "output tokens/s with the drafter against without, per concurrency",
        "4. Evaluation",
        "speedup: tokens/s with and without the drafter",
    ),
    "throughput": FigureInfo("tokens/s and model load seconds of each stage", "5. Run time", "stage throughput"),
    "estimate_vs_actual": FigureInfo(
        "the plan's estimated seconds against each stage's wall time", "5. Run time", "estimated vs actual time"
    ),
}
