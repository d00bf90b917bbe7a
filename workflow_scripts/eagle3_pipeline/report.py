"""plot_run: the run's figures for ``snakemake --report`` (PNG files under ``results/<run>/plots/``).

Every figure is drawn from files earlier stages already wrote; nothing is recounted. The
figures, their report captions and categories are :data:`eagle3_pipeline.figures.FIGURES`,
which rule plot_run's outputs are made from.

Figures are :class:`matplotlib.figure.Figure` objects built without pyplot (no global
state; they render with the Agg canvas), so each ``*_figure`` function can be unit-tested
by reading its artists.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from .figures import FIGURES
from .io import atomic_path, iter_jsonl, read_json
from .vocab import coverage_curve

DPI = 110


#: Full-model and training stages in pipeline order (the keys of ``summary.json``'s ``throughput``).
STAGE_ORDER = ("generate_traces", "extract_hidden_states", "train_drafter", "evaluate_drafter")


def save_png(fig: Figure, path: str | Path) -> None:
    """Write ``fig`` as a PNG at :data:`DPI`, atomically."""
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=DPI, format="png")


def _note(ax, text: str) -> None:
    """A centered message on an otherwise empty axes (a figure with nothing to plot says why)."""
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


# --- lengths ---------------------------------------------------------------------------------


def read_trace_lengths(traces: Iterable[str | Path]) -> tuple[np.ndarray, np.ndarray]:
    """``(prompt_tokens int64 [n], completion_tokens int64 [n])`` per trace record, in file order."""
    prompt, completion = [], []
    for path in traces:
        for _, rec in iter_jsonl(path):
            prompt.append(len(rec["prompt_token_ids"]))
            completion.append(len(rec["completion_token_ids"]))
    return np.asarray(prompt, dtype=np.int64), np.asarray(completion, dtype=np.int64)


def length_bins(values: np.ndarray, max_bins: int = 40) -> np.ndarray:
    """Bin edges for token lengths: at most ``max_bins`` bins of a whole number of tokens each,
    from the smallest to one past the largest value."""
    if values.size == 0:
        return np.array([0.0, 1.0])
    lo, hi = int(values.min()), int(values.max()) + 1
    width = max(1, -(-(hi - lo) // max_bins))
    return np.arange(lo, hi + width, width, dtype=float)


def lengths_figure(prompt: np.ndarray, completion: np.ndarray, max_tokens: int | None = None, bins: int = 40) -> Figure:
    """Histograms of prompt and completion lengths (tokens; y: records per bin).

    The completion panel marks ``max_tokens`` (generation's cap: completions that stopped
    there were truncated). Each title gives the count, median and mean.
    """
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, values, what in ((axes[0], prompt, "prompt"), (axes[1], completion, "completion")):
        if values.size == 0:
            _note(ax, f"no {what}s: no trace records")
            continue
        ax.hist(values, bins=length_bins(values, bins), color="C0" if what == "prompt" else "C1", edgecolor="white", linewidth=0.5)
        ax.set_xlabel(f"{what} length (tokens)")
        ax.set_ylabel("records")
        ax.set_title(f"{what}s: n={values.size:,}, median {np.median(values):,.0f}, mean {values.mean():,.1f}", fontsize=10)
    if max_tokens is not None and completion.size:
        axes[1].axvline(max_tokens, color="k", linestyle="--", linewidth=1, label=f"max_tokens = {max_tokens:,}")
        axes[1].legend(fontsize=8)
    return fig


# --- generation outcomes, rejects -------------------------------------------------------------


def generation_figure(summary: Mapping) -> Figure:
    """Generation outcomes in records (``summary.json``'s ``generation``) and the reasoning capture rate.

    Bars: prompts sent, completions kept (``ok``), of those truncated at ``max_tokens``, ending
    in a repetition loop and with reasoning captured, errored and rejected records. The title states the reasoning
    capture rate (completions with a reasoning trace / completions kept).
    """
    g = summary["generation"]
    labels = ["prompts", "ok", "truncated", "looping", "with reasoning", "errored", "rejected"]
    values = [g["prompts"], g["ok"], g["truncated"], g.get("repetition_loops", 0), g["reasoning_captured"], g["errored"], g["rejected"]]
    fig = Figure(figsize=(7.6, 3.6), layout="constrained")
    ax = fig.subplots()
    bars = ax.bar(labels, values, color=["C7", "C2", "C1", "C5", "C4", "C3", "C3"])
    ax.bar_label(bars, labels=[f"{v:,}" for v in values], fontsize=8)
    ax.set_ylabel("records")
    ax.set_title(
        f"generation: {g['ok']:,} completions kept of {g['prompts']:,} prompts; reasoning capture rate {g['reasoning_capture_rate']:.1%}",
        fontsize=10,
    )
    ax.margins(y=0.15)
    return fig


#: The prompts reason for records beyond ``prompts.max_prompts``: prompts not used, not bad records.
BEYOND_MAX_PROMPTS = "over_max_prompts"


def reject_counts(summary: Mapping) -> dict[str, int]:
    """``{"<stage>: <reason>": records}`` for every rejected or errored record in ``summary.json``,
    largest first (ties by name). Generation errors count under ``generation: errored``. Prompts
    beyond ``prompts.max_prompts`` (``over_max_prompts``) are not rejects and are left out
    (:func:`beyond_max_prompts`)."""
    out = {f"prompts: {k}": v for k, v in summary["prompts"]["rejects_by_reason"].items() if k != BEYOND_MAX_PROMPTS}
    out |= {f"generation: {k}": v for k, v in summary["generation"]["rejects_by_reason"].items()}
    if summary["generation"]["errored"]:
        out["generation: errored"] = summary["generation"]["errored"]
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def beyond_max_prompts(summary: Mapping) -> int:
    """Records ``prepare_prompts`` left out because ``prompts.max_prompts`` were already kept."""
    return int(summary["prompts"]["rejects_by_reason"].get(BEYOND_MAX_PROMPTS, 0))


def rejects_figure(summary: Mapping) -> Figure:
    """Rejected and errored records by stage and reason (horizontal bars, records, log scale).

    The title totals them by stage and, apart, the prompts beyond ``prompts.max_prompts``,
    which were not used rather than rejected (no bar)."""
    counts = reject_counts(summary)
    fig = Figure(figsize=(7, max(2.4, 0.9 + 0.35 * len(counts))), layout="constrained")
    ax = fig.subplots()
    beyond = beyond_max_prompts(summary)
    unused = f"\n{beyond:,} prompts beyond max_prompts, not used" if beyond else ""  # a line of its own: the title fits
    prompts = sum(v for k, v in counts.items() if k.startswith("prompts: "))
    generation = sum(counts.values()) - prompts
    ax.set_title(  # short lines: the axes start right of the reasons' labels
        f"rejected or errored records: {prompts + generation:,}\n{prompts:,} prompts, {generation:,} in generation{unused}", fontsize=10
    )
    if not counts:
        _note(ax, "no record was rejected and no generation errored")
        return fig
    names = list(counts)[::-1]
    bars = ax.barh(names, [counts[n] for n in names], color=["C3" if n.startswith("generation") else "C0" for n in names])
    ax.bar_label(bars, labels=[f"{counts[n]:,}" for n in names], fontsize=8, padding=2)
    ax.set_xscale("log")
    ax.set_xlabel("records (log scale)")
    ax.margins(x=0.15)
    return fig


# --- draft vocabulary coverage -----------------------------------------------------------------


def coverage_figure(counts: np.ndarray, coverage: Mapping) -> Figure:
    """Coverage (fraction of supervised target tokens inside the draft vocabulary) against draft
    vocabulary size (log scale, 1 to the target vocabulary size), from ``token_freq.npy``.

    The chosen size is marked (dashed line and point, labelled with ``coverage.json``'s
    coverage, measured on the mapping actually used: a warm start's inherited mapping may lie
    below the curve); a dotted line marks the number of distinct supervised tokens, where the
    curve reaches 1.
    """
    cov = coverage_curve(counts)
    n = int(coverage["draft_vocab_size"])
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    ax.plot(np.arange(1, cov.size + 1), cov, color="C0", label="best draft vocab of each size (top-N by frequency)")
    ax.axvline(n, color="C3", linestyle="--", linewidth=1, label=f"chosen size {n:,}")
    ax.plot([n], [coverage["coverage"]], "o", color="C3", label=f"chosen mapping: coverage {coverage['coverage']:.2%}")
    distinct = int(coverage["distinct_supervised_tokens"])
    if 0 < distinct < cov.size:
        ax.axvline(distinct, color="0.5", linestyle=":", linewidth=1, label=f"distinct supervised tokens {distinct:,}")
    ax.set_xscale("log")
    ax.set_xlim(1, max(cov.size, 2))
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft vocabulary size (tokens, log scale)")
    ax.set_ylabel("coverage of supervised tokens")
    ax.set_title(f"{int(counts.sum()):,} supervised tokens, target vocabulary {cov.size:,}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return fig


# --- training ------------------------------------------------------------------------------------


def read_metrics(path: str | Path) -> dict[str, list[dict]]:
    """``train/metrics.jsonl`` split by its ``split`` field: ``{"train": [...], "val": [...]}``, each by step."""
    out: dict[str, list[dict]] = {"train": [], "val": []}
    for _, rec in iter_jsonl(path):
        out.setdefault(rec.get("split", "train"), []).append(rec)
    for rows in out.values():
        rows.sort(key=lambda r: r["step"])
    return out


def positions(metrics: Mapping[str, list[dict]]) -> list[int]:
    """Draft positions with metrics (``loss_<k>`` keys), ascending."""
    ks = {int(k.split("_")[1]) for rows in metrics.values() for r in rows for k in r if k.startswith("loss_")}
    return sorted(ks)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def loss_figure(metrics: Mapping[str, list[dict]]) -> Figure:
    """Training loss per optimizer step: left, the total (sum over draft positions); right, each
    position's loss (speculators' ``training.loss``, e.g. KL divergence to the target's
    distribution, nats). Lines: training batches as logged; points: validation at
    each epoch end."""
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    axes = fig.subplots(1, 2)
    if not any(metrics.values()):
        _note(axes[0], "no training metrics")
        return fig
    axes[0].plot(*_series(metrics["train"], "loss"), color="C0", label="train")
    axes[0].plot(*_series(metrics["val"], "loss"), "o", color="C3", label="validation")
    axes[0].set_title("total loss (sum over positions)", fontsize=10)
    for k in positions(metrics):
        axes[1].plot(*_series(metrics["train"], f"loss_{k}"), color=f"C{k}", label=f"position {k}")
        axes[1].plot(*_series(metrics["val"], f"loss_{k}"), "o", color=f"C{k}")
    axes[1].set_title("per-position loss (points: validation)", fontsize=10)
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def accuracy_figure(metrics: Mapping[str, list[dict]]) -> Figure:
    """Per-position top-1 accuracy of the drafter per step: left, ``full_acc_k`` (positions 0..k all
    right: what speculative decoding accepts); right, ``cond_acc_k`` (position k right given the
    earlier ones were). Lines: training batches; points: validation at each epoch end."""
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    axes = fig.subplots(1, 2)
    if not any(metrics.values()):
        _note(axes[0], "no training metrics")
        return fig
    for ax, key, title in (
        (axes[0], "full_acc", "accuracy of positions 0..k (full_acc)"),
        (axes[1], "cond_acc", "accuracy at k given 0..k-1 right (cond_acc)"),
    ):
        for k in positions(metrics):
            ax.plot(*_series(metrics["train"], f"{key}_{k}"), color=f"C{k}", label=f"position {k}")
            ax.plot(*_series(metrics["val"], f"{key}_{k}"), "o", color=f"C{k}")
        ax.set_title(title + " (points: validation)", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("accuracy")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


# --- evaluation ---------------------------------------------------------------------------------


def acceptance_figure(acceptance: Mapping) -> Figure:
    """Speculative decoding in vLLM (``eval/acceptance.json``): left, the acceptance length τ (tokens
    per target forward pass, 1 + accepted/drafts) against its ceiling 1 + k; right, per draft
    position the fraction of drafts whose tokens up to that position were accepted, beside the
    offline validation accuracy (``full_acc_k``) the training measured for the same positions and,
    where training recorded them, the rates and τ of its validation answers replayed as vLLM
    decodes them (``replay_acc_k``, ``replay_tau``: per draft step, like vLLM's)."""
    tau, k = acceptance["acceptance_length"], acceptance["num_speculative_tokens"]
    rates = acceptance["per_position_acceptance_rate"]
    fig = Figure(figsize=(9, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[1, 3])
    bar = left.bar(["τ"], [tau], color="C2")
    # inside the bar: the replayed validation τ is drawn as a dot at the bar's top, often next to it
    left.bar_label(bar, labels=[f"{tau:.3f}"], fontsize=9, label_type="center", color="white")
    left.axhline(1 + k, color="k", linestyle="--", linewidth=1, label=f"ceiling 1 + k = {1 + k}")
    left.axhline(1, color="0.5", linewidth=1)
    left.set_ylim(0, 1 + k + 0.3)
    left.set_ylabel("tokens per target step")
    left.legend(fontsize=8, loc="upper right")
    left.set_title("acceptance length", fontsize=10)
    pos = np.arange(len(rates))
    bars = right.bar(pos, rates, color="C2", label="vLLM: accepted / drafts")
    right.bar_label(bars, labels=[f"{r:.3f}" for r in rates], fontsize=8)
    offline = acceptance.get("offline_validation") or {}
    off = [offline.get(f"full_acc_{i}") for i in pos]
    if any(v is not None for v in off):
        # the markers sit left and right of each bar's centre, clear of its value label
        right.plot(pos - 0.25, [np.nan if v is None else v for v in off], "D", color="C3", label="training validation full_acc (per token)")
    replay = [offline.get(f"replay_acc_{i}") for i in pos]
    if any(v is not None for v in replay):
        right.plot(
            pos + 0.25,
            [np.nan if v is None else v for v in replay],
            "o",
            color="C1",
            label="validation answers replayed as vLLM drafts (per draft)",
        )
        off += replay
    if offline.get("replay_tau") is not None:
        left.plot(["τ"], [offline["replay_tau"]], "o", color="C1", label=f"validation replayed: {offline['replay_tau']:.3f}")
        left.legend(fontsize=8, loc="upper right")
    right.set_xticks(pos, [str(i) for i in pos])
    right.set_xlabel("draft position")
    right.set_ylabel("acceptance rate")
    right.set_ylim(0, max([1e-3, *rates, *(v for v in off if v is not None)]) * 1.25)
    right.legend(fontsize=8)
    right.set_title(f"{acceptance['num_prompts']:,} prompts, {acceptance['num_drafts']:,} drafts of k = {k}", fontsize=10)
    return fig


def speedup_figure(acceptance: Mapping) -> Figure:
    """What the drafter buys (``eval/acceptance.json``'s ``speedup``): output tokens/s decoding the
    evaluation prompts with and without the drafter at each number of requests in flight, grouped
    bars, each pair labelled with its ratio (the speedup)."""
    rows = acceptance.get("speedup") or []
    fig = Figure(figsize=(8, 3.6), layout="constrained")
    ax = fig.subplots()
    if not rows:
        _note(ax, "no speedup measured (evaluation.speedup.concurrency is empty)")
        return fig
    x = np.arange(len(rows))
    w = 0.38
    ax.bar(x - w / 2, [r["without_drafter_tokens_per_second"] for r in rows], w, color="0.6", label="target alone")
    bars = ax.bar(x + w / 2, [r["with_drafter_tokens_per_second"] for r in rows], w, color="C2", label="with the drafter")
    ax.bar_label(bars, labels=[f"{r['speedup']:.2f}x" if r.get("speedup") else "" for r in rows], fontsize=9)
    ax.set_xticks(x, [f"{r['concurrency']} in flight\n({r['requests']} requests)" for r in rows])
    ax.set_ylabel("output tokens / s")
    ax.margins(y=0.15)
    ax.legend(fontsize=8)
    ax.set_title(
        f"decoding throughput, k = {acceptance.get('num_speculative_tokens')}, τ = {acceptance['acceptance_length']:.2f}", fontsize=10
    )
    return fig


# --- run time -----------------------------------------------------------------------------------


def throughput_figure(summary: Mapping) -> Figure:
    """Each full-model or training stage's throughput (tokens/s of work, model load excluded)
    from ``summary.json``'s ``throughput``; each bar is labelled with its model load seconds."""
    tp = summary.get("throughput") or {}
    stages = [s for s in STAGE_ORDER if s in tp] + sorted(set(tp) - set(STAGE_ORDER))
    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.subplots()
    if not stages:
        _note(ax, "no stage recorded its throughput")
        return fig
    names = stages[::-1]
    bars = ax.barh(names, [tp[s]["tokens_per_second"] for s in names], color="C0")
    ax.bar_label(
        bars, labels=[f"{tp[s]['tokens_per_second']:,.0f} tok/s, load {tp[s]['load_seconds']:,.0f} s" for s in names], fontsize=8, padding=2
    )
    ax.set_xlabel("tokens per second")
    ax.set_title("tokens per second of work per stage (model load excluded)", fontsize=10)
    ax.margins(x=0.35)
    return fig


def estimate_figure(summary: Mapping) -> Figure:
    """The plan's estimated seconds against each stage's wall time (``summary.json``'s
    ``estimate_vs_actual``: per stage, the latest start plan in which it was pending, so the
    stages of every start and resume of the run), grouped bars, each actual bar labelled with
    actual / estimate."""
    rows = [r for r in summary.get("estimate_vs_actual") or [] if r.get("estimated_seconds") is not None]
    fig = Figure(figsize=(8, 3.6), layout="constrained")
    ax = fig.subplots()
    if not rows:
        _note(ax, "no estimate to compare: no start plan had a pending stage (results/<run>/plans/)")
        return fig
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["estimated_seconds"] for r in rows], width=0.4, color="C7", label="estimated (start plan)")
    actual = [r["actual_seconds"] if r["actual_seconds"] is not None else np.nan for r in rows]
    bars = ax.bar(x + 0.2, actual, width=0.4, color="C0", label="actual (wall time)")
    ax.bar_label(
        bars, labels=["" if r["actual_over_estimate"] is None else f"{r['actual_over_estimate']:.2f}x" for r in rows], fontsize=8, padding=2
    )
    ax.set_xticks(x, [r["stage"] for r in rows], fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title("estimate vs actual per stage (label: actual / estimate)", fontsize=10)
    ax.margins(y=0.15)
    ax.legend(fontsize=8)
    return fig


def make_plots(
    traces: Iterable[str | Path],
    token_freq: str | Path,
    coverage: str | Path,
    metrics: str | Path,
    acceptance: str | Path,
    summary: str | Path,
    out: Mapping[str, str | Path],
    max_tokens: int | None = None,
) -> None:
    """Draw every figure of :data:`FIGURES` from a run's files and write each to ``out[name]``.

    Args:
        traces: ``traces/shard-*.jsonl``; token_freq: ``vocab/token_freq.npy``; coverage:
        ``vocab/coverage.json``; metrics: ``train/metrics.jsonl``; acceptance:
        ``eval/acceptance.json``; summary: ``summary.json``; max_tokens: generation's cap, marked
        on the completion histogram.
    """
    s = read_json(summary)
    m = read_metrics(metrics)
    figures = {
        "lengths": lambda: lengths_figure(*read_trace_lengths(traces), max_tokens=max_tokens),
        "generation": lambda: generation_figure(s),
        "rejects": lambda: rejects_figure(s),
        "vocab_coverage": lambda: coverage_figure(np.load(token_freq), read_json(coverage)),
        "training_loss": lambda: loss_figure(m),
        "training_accuracy": lambda: accuracy_figure(m),
        "acceptance": lambda: acceptance_figure(read_json(acceptance)),
        "speedup": lambda: speedup_figure(read_json(acceptance)),
        "throughput": lambda: throughput_figure(s),
        "estimate_vs_actual": lambda: estimate_figure(s),
    }
    for name in FIGURES:
        save_png(figures[name](), out[name])
