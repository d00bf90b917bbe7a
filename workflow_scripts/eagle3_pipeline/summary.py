"""summarize_run: one ``summary.json`` per run with every stage's counts, rejects and results."""

from __future__ import annotations

from collections import Counter

from .io import read_json
from .layout import RunLayout


def summarize(prompts: str, traces: list[str], coverage: str, hidden_indexes: list[str], train: str, acceptance: str) -> dict:
    """Merge the stage manifests of a run into one summary.

    Args:
        prompts: ``prompts/summary.json``; traces: ``traces/shard-*.summary.json``;
        coverage: ``vocab/coverage.json``; hidden_indexes: ``hidden_states/shard-*.index.json``;
        train: ``train/summary.json``; acceptance: ``eval/acceptance.json``.

    Returns:
        ``{"prompts", "generation", "vocab", "hidden_states", "training", "evaluation",
        "rejects"}`` where ``rejects`` totals every dropped record by stage and reason.
    """
    p = read_json(prompts)
    ts = [read_json(t) for t in traces]
    gen_rejects: Counter = Counter()
    for t in ts:
        gen_rejects.update(t["rejects_by_reason"])
    ok = sum(t["ok"] for t in ts)
    reasoning = sum(t["reasoning_captured"] for t in ts)
    generation = {
        "shards": len(ts),
        "prompts": sum(t["prompts"] for t in ts),
        "ok": ok,
        "errored": sum(t["errored"] for t in ts),
        "truncated": sum(t["truncated"] for t in ts),
        "repetition_loops": sum(t.get("repetition_loops", 0) for t in ts),  # absent from traces generated before it was counted
        "rejected": sum(t["rejected"] for t in ts),
        "rejects_by_reason": dict(sorted(gen_rejects.items())),
        "reasoning_captured": reasoning,
        "reasoning_capture_rate": reasoning / ok if ok else 0.0,
        "prompt_tokens": sum(t["prompt_tokens"] for t in ts),
        "completion_tokens": sum(t["completion_tokens"] for t in ts),
    }
    cov = read_json(coverage)
    hs = [read_json(h) for h in hidden_indexes]
    tr = read_json(train)
    acc = read_json(acceptance)
    return {
        "prompts": {k: p[k] for k in ("read", "kept", "rejected", "rejects_by_reason")}
        | {"blank_lines": p.get("blank_lines", 0), "dropped_turns": p.get("dropped_turns", {})},
        "generation": generation,
        "vocab": {k: cov[k] for k in ("draft_vocab_size", "target_vocab_size", "coverage", "distinct_supervised_tokens")},
        "hidden_states": {
            "samples": sum(h["num_samples"] for h in hs),
            "tokens": sum(h["num_tokens"] for h in hs),
            "bytes": sum(h["bytes"] for h in hs),
            "layer_ids": hs[0]["layer_ids"] if hs else [],
            "backend": hs[0].get("backend") if hs else None,
        },
        "training": {k: tr.get(k) for k in ("steps", "tokens_seen", "tokens_per_second", "final_val")},
        "evaluation": {k: acc[k] for k in ("acceptance_length", "per_position_acceptance_rate", "num_prompts", "num_drafts")}
        | {"rejected_prompts": acc.get("rejected_prompts", 0)}
        | {
            "speedup": [
                {k: r[k] for k in ("concurrency", "with_drafter_tokens_per_second", "without_drafter_tokens_per_second", "speedup")}
                for r in acc.get("speedup") or []
            ]
        },
        "rejects": {
            "prompts": p["rejected"],
            "generation": generation["rejected"],
            "evaluation": acc.get("rejected_prompts", 0),
            "total": p["rejected"] + generation["rejected"] + acc.get("rejected_prompts", 0),
        },
    }


def result_lines(run_dir: str) -> str:
    """What ``make run`` prints at the end of a run in ``run_dir`` (``results/<run>``): the drafter's
    folder, and ``eval/acceptance.json`` with τ and the speedup at each concurrency measured (output
    tokens/s with the drafter over without, the evaluation's ``speedup`` records), e.g.::

        drafter: results/default/drafter
        acceptance: results/default/eval/acceptance.json (tau = 1.224; speedup 0.50x at 8 in flight)

    Raises:
        OSError, ValueError: ``eval/acceptance.json`` is missing or not JSON (the run has not finished).
    """
    lay = RunLayout.at(run_dir)
    acc_path = lay.acceptance()
    acc = read_json(acc_path)
    parts = [f"tau = {acc['acceptance_length']:.3f}"]
    rows = [r for r in acc.get("speedup") or [] if r.get("speedup") is not None]
    if rows:
        parts.append("speedup " + ", ".join(f"{r['speedup']:.2f}x at {r['concurrency']} in flight" for r in rows))
    return f"drafter: {lay.drafter()}\nacceptance: {acc_path} ({'; '.join(parts)})"
