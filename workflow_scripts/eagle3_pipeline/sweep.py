"""Drafter sweeps inside one run: variants of the vocab, training and evaluation settings.

A run's ``sweep.variants`` maps a name to the settings that differ from the run's own
(``{"ttt5": {"training": {"ttt_steps": 5}}}``). Every variant reuses the run's prompts,
traces and hidden states; it gets its own draft vocab only when its vocab settings differ,
its own drafter only when its vocab or training settings differ, and always its own
evaluation, under ``results/<run>/sweep/<name>/``. :func:`sweep_rows` and
:func:`format_table` then put the run's drafter and every variant in one table of τ and
training cost (``results/<run>/sweep.json`` and ``sweep.md``).

Changing the target, the prompts, generation or extraction (aux layer ids included) changes
the traces or hidden states: that is another run, not a variant.
"""

from __future__ import annotations

import copy
import re
from typing import TYPE_CHECKING

from .config import ConfigError, result_settings, runtime_keys, validate_config

if TYPE_CHECKING:
    from .layout import RunLayout

#: A variant's name: a folder name under results/<run>/sweep/ (not ".", "..", hidden or a path).
NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
#: Sections a variant may change, and the keys of those that every variant shares.
VARIANT_SECTIONS = ("vocab", "training", "evaluation")
SHARED_KEYS = {("evaluation", "prompts"), ("evaluation", "max_prompts")}


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def variant_configs(cfg: dict) -> dict[str, dict]:
    """The full, validated config of each variant in ``cfg["sweep"]["variants"]``.

    Args:
        cfg: the run's validated config.

    Returns:
        ``{name: config}``: the run's config with the variant's settings merged in (nested
        keys merged, lists replaced) and no variants of its own, in the order given.

    Raises:
        ConfigError: naming the variant and key: an unknown or invalid setting (the schema's
            message), a shared setting (``evaluation.prompts``, ``evaluation.max_prompts``),
            a variant equal to the run's own settings, or a name that is not a folder name (``..``, ``a/b``, a
            number or boolean as YAML reads ``1:`` or ``yes:``).
    """
    out = {}
    for name, over in cfg["sweep"]["variants"].items():
        # YAML reads `1:` or `yes:` as a number or boolean, which the schema's name pattern does not see
        if not isinstance(name, str) or not re.fullmatch(NAME, name):
            raise ConfigError(
                f"sweep.variants: {name!r} is not a variant name: letters, digits, '.', '_', '-', starting with a letter "
                "or digit (it names a folder); quote names YAML reads as numbers or booleans"
            )
        for section, key in sorted(SHARED_KEYS):
            if key in over.get(section, {}):
                raise ConfigError(
                    f"sweep.variants.{name}.{section}.{key}: every variant is evaluated on the run's own prompts; "
                    "use another run for other evaluation prompts"
                )
        try:
            merged = validate_config(_merge({**cfg, "sweep": {}}, over))
        except ConfigError as e:
            raise ConfigError(f"sweep.variants.{name}: {e}") from None
        if all(result_settings(merged, s) == result_settings(cfg, s) for s in VARIANT_SECTIONS):
            raise ConfigError(f"sweep.variants.{name}: changes nothing from the run's own settings")
        out[name] = merged
    return out


def shares_vocab(run_cfg: dict, variant_cfg: dict) -> bool:
    """Whether a variant's draft vocab (d2t/t2d) is the run's own: same vocab settings and warm start."""
    return run_cfg["vocab"] == variant_cfg["vocab"] and run_cfg["training"]["init_from"] == variant_cfg["training"]["init_from"]


def shares_drafter(run_cfg: dict, variant_cfg: dict) -> bool:
    """Whether a variant's drafter is the run's own: same vocab and training settings (it differs in evaluation only)."""
    return shares_vocab(run_cfg, variant_cfg) and result_settings(run_cfg, "training") == result_settings(variant_cfg, "training")


def changes(run_cfg: dict, variant_cfg: dict) -> dict[str, object]:
    """``{"section.key": value}`` of every setting in which the variant differs from the run, by key
    (the reports' order, whatever order the configs hold them in)."""
    return dict(
        sorted(
            (f"{s}.{k}", v)
            for s in VARIANT_SECTIONS
            for k, v in variant_cfg[s].items()
            if run_cfg[s].get(k) != v and k not in runtime_keys(s)
        )
    )


def vocab_layout(run_cfg: dict, variant_cfg: dict, layout: RunLayout, name: str) -> RunLayout:
    """The layout whose draft vocab variant ``name`` uses: the run's (``layout``) unless the variant's
    vocab settings differ (:func:`shares_vocab`), then its own (``layout.variant(name)``)."""
    return layout if shares_vocab(run_cfg, variant_cfg) else layout.variant(name)


def drafter_layout(run_cfg: dict, variant_cfg: dict, layout: RunLayout, name: str) -> RunLayout:
    """The layout whose drafter variant ``name`` uses: the run's (``layout``) unless the variant's vocab
    or training settings differ (:func:`shares_drafter`), then its own (``layout.variant(name)``)."""
    return layout if shares_drafter(run_cfg, variant_cfg) else layout.variant(name)


def sweep_rows(run_cfg: dict, variants: dict[str, dict], layout: RunLayout) -> list[dict]:
    """The drafters of the sweep table, the run's own first, then each variant in order.

    Args:
        run_cfg: the run's validated config.
        variants: each variant's full config (:func:`variant_configs`).
        layout: the run's layout.

    Returns:
        one ``{"name", "changes", "shared", "acceptance", "train_summary", "coverage"}`` per drafter:
        ``"(run)"`` or the variant's name, what differs from the run (:func:`changes`), whether the
        drafter is the run's own (:func:`shares_drafter`), and the paths of its evaluation, of the
        training summary of the drafter it uses and of the coverage of the vocab it uses.
    """
    rows = [
        {
            "name": "(run)",
            "changes": {},
            "shared": False,
            "acceptance": layout.acceptance(),
            "train_summary": layout.train_summary(),
            "coverage": layout.coverage(),
        }
    ]
    for name, cfg in variants.items():
        rows.append(
            {
                "name": name,
                "changes": changes(run_cfg, cfg),
                "shared": shares_drafter(run_cfg, cfg),
                "acceptance": layout.variant(name).acceptance(),
                "train_summary": drafter_layout(run_cfg, cfg, layout, name).train_summary(),
                "coverage": vocab_layout(run_cfg, cfg, layout, name).coverage(),
            }
        )
    return rows


def sweep_row(name: str, setting: dict, acceptance: dict, train_summary: dict, coverage: dict, shared: bool) -> dict:
    """One row of the sweep table from a drafter's evaluation, training summary and vocab coverage.

    Args:
        name: ``"(run)"`` for the run's own drafter, else the variant's name.
        setting: what differs from the run (:func:`changes`), empty for the run's row.
        acceptance: its ``eval/acceptance.json`` (τ = 1 + accepted / drafts, per position).
        train_summary: the drafter's ``train/summary.json`` (the run's when ``shared``).
        coverage: the draft vocab's ``vocab/coverage.json``.
        shared: whether the drafter is the run's own (a variant of the evaluation only), so
            its training cost is not counted again.

    Returns:
        ``{"variant", "changes", "tau", "per_position", "num_speculative_tokens",
        "draft_vocab_size", "coverage", "ttt_steps", "epochs", "train_samples",
        "tokens_seen", "train_seconds", "val_full_acc"}``; seconds are wall-clock seconds of
        training, over every attempt of a resumed one (``None`` where the drafter is shared).
    """
    val = train_summary.get("final_val") or {}
    k = len(acceptance["per_position_acceptance_rate"])
    return {
        "variant": name,
        "changes": setting,
        "tau": acceptance["acceptance_length"],
        "per_position": acceptance["per_position_acceptance_rate"],
        "num_speculative_tokens": acceptance["num_speculative_tokens"],
        "draft_vocab_size": coverage["draft_vocab_size"],
        "coverage": coverage["coverage"],
        "ttt_steps": train_summary.get("ttt_steps"),
        "epochs": train_summary.get("epochs"),
        "train_samples": train_summary.get("train_samples"),
        "tokens_seen": train_summary.get("tokens_seen"),
        # every attempt of a resumed training, up to its checkpoints (older summaries: this attempt)
        "train_seconds": None if shared else train_summary.get("total_seconds", train_summary.get("seconds")),
        "val_full_acc": [val.get(f"full_acc_{i}") for i in range(k)],
    }


def format_table(rows: list[dict]) -> str:
    """The sweep as a Markdown table, one line per drafter, best τ first."""

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    head = (
        "| variant | changes | τ | accepted per position | k | draft vocab (coverage) | TTT | epochs | train samples | "
        "tokens seen | train s | offline full acc |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in sorted(rows, key=lambda r: -r["tau"]):
        setting = ", ".join(f"{k}={v}" for k, v in r["changes"].items()) or "(the run's own)"
        lines.append(
            f"| {r['variant']} | {setting} | {r['tau']:.3f} | {' / '.join(f'{p:.2f}' for p in r['per_position'])} | "
            f"{r['num_speculative_tokens']} | {r['draft_vocab_size']} ({r['coverage']:.4f}) | {num(r['ttt_steps'], 'd')} | "
            f"{num(r['epochs'], 'd')} | {num(r['train_samples'], ',')} | {num(r['tokens_seen'], ',')} | "
            f"{num(r['train_seconds'], '.0f')} | {' / '.join(num(a, '.2f') for a in r['val_full_acc'])} |"
        )
    return "\n".join(lines) + "\n"
