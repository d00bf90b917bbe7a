"""build_vocab_mapping: supervised-token frequencies → draft vocabulary (d2t / t2d).

The mapping itself is speculators' ``build_vocab_mappings_from_distribution``: the top
``N`` target ids by supervised frequency (ties → lower id), padded with the lowest
unused ids when fewer than ``N`` ids occur, sorted ascending. ``d2t`` (int64 ``[N]``)
holds offsets, ``target_id = draft_idx + d2t[draft_idx]``; ``t2d`` (bool ``[V]``) has
exactly ``N`` true entries. Only supervised tokens (loss mask 1: the completion) count.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from .io import InputError


def count_supervised_tokens(completions: Iterable[Sequence[int]], target_vocab_size: int) -> np.ndarray:
    """Frequency of each target token id over the supervised (completion) tokens.

    Args:
        completions: per sample, the completion token ids (loss mask 1).
        target_vocab_size: ``V``.

    Returns:
        ``int64 [V]`` counts.

    Raises:
        InputError: a token id is outside ``[0, V)`` (the traces do not belong to this target).
    """
    counts = np.zeros(target_vocab_size, dtype=np.int64)
    for ids in completions:
        a = np.asarray(ids, dtype=np.int64)
        if a.size == 0:
            continue
        if a.min() < 0 or a.max() >= target_vocab_size:
            raise InputError(f"token id {int(a.max())} outside the target vocabulary of {target_vocab_size}: traces from another model?")
        counts += np.bincount(a, minlength=target_vocab_size)
    return counts


def build_mapping(counts: np.ndarray, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(d2t int64 [N], t2d bool [V])`` from token counts, by speculators' builder.

    Raises:
        InputError: ``draft_vocab_size`` is not in ``[1, V]``.
    """
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    v = int(counts.shape[0])
    if not 1 <= draft_vocab_size <= v:
        raise InputError(f"vocab.draft_vocab_size={draft_vocab_size} must be between 1 and the target vocabulary size {v}")
    nz = np.flatnonzero(counts)
    freq = dict(zip(nz.tolist(), counts[nz].tolist(), strict=True))
    d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab_size, v)
    return d2t.numpy().astype(np.int64), t2d.numpy().astype(bool)


def coverage_ladder(counts: np.ndarray, sizes: Iterable[int]) -> dict[int, float]:
    """Fraction of supervised-token mass inside the best draft vocab of each size.

    The best vocab of size ``N`` is the top-``N`` ids by count, so its coverage is the
    sum of the ``N`` largest counts over the total.
    """
    total = int(counts.sum())
    desc = np.sort(counts)[::-1]
    cum = np.cumsum(desc)
    out = {}
    for n in sorted(set(int(s) for s in sizes)):
        n_eff = min(n, len(desc))
        out[n] = float(cum[n_eff - 1] / total) if total and n_eff > 0 else 0.0
    return out


def default_ladder(target_vocab_size: int, draft_vocab_size: int) -> list[int]:
    """Powers of two from 256 up to ``V``, plus ``V`` and the chosen ``N``."""
    sizes = {target_vocab_size, draft_vocab_size}
    s = 256
    while s < target_vocab_size:
        sizes.add(s)
        s *= 2
    return sorted(sizes)


def coverage_report(counts: np.ndarray, t2d: np.ndarray, draft_vocab_size: int) -> dict:
    """The ``coverage.json`` contents.

    ``coverage`` is measured directly on the chosen mapping (``counts[t2d].sum() /
    counts.sum()``); ``ladder`` lists ``{"draft_vocab_size", "coverage"}`` at other sizes
    (ascending), from sorted counts.
    """
    total = int(counts.sum())
    return {
        "draft_vocab_size": int(draft_vocab_size),
        "target_vocab_size": int(counts.shape[0]),
        "supervised_tokens": total,
        "distinct_supervised_tokens": int(np.count_nonzero(counts)),
        "coverage": float(counts[t2d].sum() / total) if total else 0.0,
        "ladder": [
            {"draft_vocab_size": k, "coverage": v}
            for k, v in coverage_ladder(counts, default_ladder(counts.shape[0], draft_vocab_size)).items()
        ],
    }
