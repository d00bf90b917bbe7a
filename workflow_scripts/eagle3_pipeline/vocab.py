"""build_vocab_mapping: supervised-token frequencies → draft vocabulary (d2t / t2d).

The mapping itself is speculators' ``build_vocab_mappings_from_distribution``: the top
``N`` target ids by supervised frequency (ties → lower id), padded with the lowest
unused ids when fewer than ``N`` ids occur, sorted ascending, as ``d2t``/``t2d``
(:mod:`eagle3_pipeline.conventions`: draft vocabulary). The tokens counted are every trace's
completion (the tokens the loss mask supervises), before training's choices of which to use
(its validation split, ``max_train_samples``, a trimmed or dropped looping answer).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from .conventions import draft_to_target
from .io import InputError


def recorded_completions(trace_paths: Iterable[str | Path]) -> Iterable[list[int]]:
    """Every trace's ``completion_token_ids`` (list of int target ids), shard by shard, each shard
    first checked against the SHA-256 generation recorded in its ``.summary.json``
    (:func:`eagle3_pipeline.generation.recorded_traces_sha256`), so the vocab is never counted from
    bytes other than those generation wrote.

    Raises:
        InputError: a shard differs from its record (naming the shard, both hashes and what to do).
    """
    from .generation import recorded_traces_sha256
    from .io import read_jsonl

    for path in trace_paths:
        recorded_traces_sha256(path)
        yield from (t["completion_token_ids"] for t in read_jsonl(path))


def count_supervised_tokens(completions: Iterable[Sequence[int]], target_vocab_size: int, *, batch_tokens: int = 1 << 22) -> np.ndarray:
    """Frequency of each target token id over the supervised (completion) tokens.

    Ids are gathered into batches of about ``batch_tokens`` and counted with one
    ``np.bincount`` per batch (one bincount per sample costs O(V) each: 2 s for 40K
    samples at V = 163,840). ``benchmarks/cpu_figures.py`` measures it.

    Args:
        completions: per sample, the completion token ids (loss mask 1).
        target_vocab_size: ``V``.
        batch_tokens: ids per bincount (memory: 8 bytes each).

    Returns:
        ``int64 [V]`` counts.

    Raises:
        InputError: a token id is outside ``[0, V)`` (the traces do not belong to this target).
    """
    counts = np.zeros(target_vocab_size, dtype=np.int64)
    pending: list[np.ndarray] = []
    size = 0

    def flush() -> None:
        nonlocal size
        if not pending:
            return
        a = np.concatenate(pending)
        pending.clear()
        size = 0
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi >= target_vocab_size:
            bad = hi if hi >= target_vocab_size else lo
            raise InputError(f"token id {bad} outside the target vocabulary of {target_vocab_size}: traces from another model?")
        counts[:] += np.bincount(a, minlength=target_vocab_size)

    for ids in completions:
        a = np.asarray(ids, dtype=np.int64)
        if a.size:
            pending.append(a)
            size += a.size
            if size >= batch_tokens:
                flush()
    flush()
    return counts


def build_mapping(counts: np.ndarray, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(d2t int64 [N], t2d bool [V])`` from token counts, by speculators' builder.

    Raises:
        InputError: ``draft_vocab_size`` is not in ``[1, V]``, or there are no
            supervised tokens at all.
    """
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    v = int(counts.shape[0])
    if not counts.any():
        raise InputError("no supervised tokens in the traces: every completion is empty; check the generate_traces logs and rejects")
    if not 1 <= draft_vocab_size <= v:
        raise InputError(f"vocab.draft_vocab_size={draft_vocab_size} must be between 1 and the target vocabulary size {v}")
    nz = np.flatnonzero(counts)
    freq = dict(zip(nz.tolist(), counts[nz].tolist(), strict=True))
    d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab_size, v)
    return d2t.numpy().astype(np.int64), t2d.numpy().astype(bool)


def load_mapping_from_drafter(drafter_dir: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """``(d2t int64 [N], t2d bool [V])`` stored in a speculators EAGLE-3 checkpoint.

    Used for warm starts: a drafter keeps the draft vocabulary it was trained with.

    Raises:
        InputError: the directory has no ``model.safetensors`` with ``d2t``/``t2d``.
    """
    from safetensors import safe_open

    path = Path(drafter_dir) / "model.safetensors"
    if not path.is_file():
        raise InputError(f"training.init_from: {path} does not exist; point it at a drafter directory (results/<run>/drafter)")
    with safe_open(str(path), framework="np") as f:
        keys = set(f.keys())
        if not {"d2t", "t2d"} <= keys:
            raise InputError(f"{path} has no d2t/t2d tensors: not an EAGLE-3 drafter with a draft vocabulary")
        return f.get_tensor("d2t").astype(np.int64), f.get_tensor("t2d").astype(bool)


def mapping_problem(d2t: np.ndarray, t2d: np.ndarray) -> str | None:
    """What makes ``(d2t, t2d)`` not one draft vocabulary (the module's convention), or None.

    ``d2t`` must be integer ``[N]`` and ``t2d`` bool ``[V]``; the target ids
    ``arange(N) + d2t`` strictly ascending within ``[0, V)`` (speculators' builder sorts them),
    and exactly those ids true in ``t2d``. A value read from damaged bytes (e.g. ``2**34 + 46``)
    fails the range check, which is all vLLM's own lookup would see, as an index error in its engine.
    """
    if d2t.ndim != 1 or t2d.ndim != 1 or not np.issubdtype(d2t.dtype, np.integer) or t2d.dtype != np.bool_:
        return f"d2t {d2t.dtype} {list(d2t.shape)} and t2d {t2d.dtype} {list(t2d.shape)} are not int [N] and bool [V]"
    ids = draft_to_target(d2t)
    if ids.size and (bad := np.flatnonzero((ids < 0) | (ids >= t2d.shape[0]))).size:
        i = int(bad[0])
        return f"d2t[{i}] = {int(d2t[i])} maps draft id {i} to target id {int(ids[i])}, outside the target vocabulary of {t2d.shape[0]}"
    if ids.size > 1 and (bad := np.flatnonzero(np.diff(ids) <= 0)).size:
        i = int(bad[0]) + 1
        return f"d2t[{i}] = {int(d2t[i])} maps draft id {i} to target id {int(ids[i])}, not above draft id {i - 1}'s {int(ids[i - 1])}"
    if int(t2d.sum()) != ids.size or not bool(t2d[ids].all()):
        return f"t2d marks {int(t2d.sum())} target ids, not the {ids.size} that d2t maps to"
    return None


def load_mapping(vocab_dir: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """The run's draft vocabulary ``(d2t int64 [N], t2d bool [V])`` from ``d2t.npy`` and
    ``t2d.npy`` in ``vocab_dir`` (build_vocab_mapping's output), checked by :func:`mapping_problem`.

    Raises:
        InputError: the two are not one draft vocabulary (naming the folder, the first bad entry
            and what to do).
    """
    d2t, t2d = np.load(Path(vocab_dir) / "d2t.npy"), np.load(Path(vocab_dir) / "t2d.npy")
    if problem := mapping_problem(d2t, t2d):
        raise InputError(
            f"{vocab_dir}: not a draft vocabulary: {problem}; its files were changed after build_vocab_mapping wrote them: "
            f"remake them with `snakemake --forcerun {Path(vocab_dir) / 'd2t.npy'}`"
        )
    return d2t.astype(np.int64), t2d


def choose_mapping(counts: np.ndarray, draft_vocab_size: int, init_from: str | Path | None = None) -> tuple[np.ndarray, np.ndarray, str]:
    """The run's ``(d2t, t2d, origin)``: inherited from a warm-start drafter, else built.

    A warm start keeps the drafter's own mapping (its ``lm_head`` rows are indexed by
    it); ``counts`` then only measure its coverage on the new data.

    Raises:
        InputError: the inherited mapping does not match ``draft_vocab_size`` or the
            target vocabulary size.
    """
    if init_from is None:
        d2t, t2d = build_mapping(counts, draft_vocab_size)
        return d2t, t2d, "built from supervised-token counts"
    d2t, t2d = load_mapping_from_drafter(init_from)
    if d2t.shape[0] != draft_vocab_size:
        raise InputError(f"training.init_from={init_from} has a draft vocab of {d2t.shape[0]}; set vocab.draft_vocab_size: {d2t.shape[0]}")
    if t2d.shape[0] != counts.shape[0]:
        raise InputError(
            f"training.init_from={init_from} was trained for a target vocabulary of {t2d.shape[0]}, this target has {counts.shape[0]}"
        )
    return d2t, t2d, f"kept from {init_from}"


def coverage_curve(counts: np.ndarray) -> np.ndarray:
    """Coverage of the best draft vocab of each size: ``float64 [V]``, entry ``N-1`` the
    supervised-token mass of the ``N`` most frequent target ids over the total (all zeros
    when there are no supervised tokens).

    The best vocab of size ``N`` is the top-``N`` ids by count, so its coverage is the
    sum of the ``N`` largest counts over the total.
    """
    total = int(counts.sum())
    if total == 0:
        return np.zeros(counts.shape[0])
    return np.cumsum(np.sort(counts)[::-1]) / total


def coverage_ladder(counts: np.ndarray, sizes: Iterable[int]) -> dict[int, float]:
    """:func:`coverage_curve` at each of ``sizes`` (sizes above ``V`` give the full coverage)."""
    curve = coverage_curve(counts)
    out = {}
    for n in sorted(set(int(s) for s in sizes)):
        n_eff = min(n, len(curve))
        out[n] = float(curve[n_eff - 1]) if n_eff > 0 else 0.0
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
