"""What vLLM would accept from a drafter's drafts: speculative decoding replayed offline.

vLLM's EAGLE-3 proposer drafts ``k`` tokens from the last token the target emitted (the
*anchor*); the target accepts the longest correct prefix of the draft and emits one token of
its own after it, and the next draft starts from that token. vLLM counts per draft step
(:mod:`eagle3_pipeline.evaluation`): τ = 1 + accepted / drafts, and the rate at position
``j`` = drafts with more than ``j`` tokens accepted / drafts.

Offline (training's validation, ``benchmarks/drafter_gap.py``), the drafter drafts from
every position of a known answer at once: speculators' ``Eagle3DraftModel.forward`` returns,
for each TTT step ``j``, the draft made at every row. Its ``full_acc_j`` is token-weighted:
the fraction of all anchors whose first ``j + 1`` drafts are right. vLLM's rates are
weighted by draft steps instead: with ``k = 3`` an easy stretch takes one step per four
tokens and a hard one a step per token, so hard anchors weigh more. :func:`replay_decoding`
walks each answer as vLLM would (start after the first answer token, jump by accepted + 1)
and counts what vLLM's counters would, so the two can be compared on the same tokens.

Row convention (speculators' ``shift_batch``, which every batch here has been through): row
``i`` feeds the drafter the token ``input_ids[i]`` with the target's hidden state of the row
before it, and step ``j`` of the draft made at row ``i`` guesses ``input_ids[i + 1 + j]``.
``loss_mask[i]`` is 1 where ``input_ids[i]`` is a token the target generated.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .conventions import draft_to_target


def draft_target_ids(draft_tokens: Sequence, d2t: np.ndarray) -> np.ndarray:
    """speculators' per-step drafts (draft-vocab indices) as target token ids.

    Args:
        draft_tokens: ``k`` tensors or arrays ``[1, T]`` or ``[T]`` of draft-vocab indices (the
            first value ``Eagle3DraftModel.forward`` returns).
        d2t: int64 ``[N]`` offsets (:func:`eagle3_pipeline.conventions.draft_to_target`).

    Returns:
        int64 ``[k, T]`` target token ids.
    """
    rows = [np.asarray(t.detach().cpu() if hasattr(t, "detach") else t).reshape(-1) for t in draft_tokens]
    return draft_to_target(d2t, np.stack(rows))


def accepted_lengths(
    drafts: np.ndarray, input_ids: np.ndarray, loss_mask: np.ndarray, document_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per row: how many of the draft's tokens the target would accept, and whether vLLM drafts there.

    Step ``j`` at row ``i`` is right when ``drafts[j, i] == input_ids[i + 1 + j]`` and that
    token is a generated token of the same sample (same ``document_ids``, ``loss_mask`` 1);
    a draft is accepted up to its first wrong step.

    Args:
        drafts: int64 ``[k, T]`` target ids (:func:`draft_target_ids`).
        input_ids: int ``[T]``; loss_mask: bool ``[T]``; document_ids: int ``[T]`` (a packed
            batch's sample of each row; -1 for padding).

    Returns:
        ``(accepted, anchors)``: int64 ``[T]`` in ``0..k``, and bool ``[T]``: rows where vLLM
        would draft (the row's token is generated and a generated token of the same sample
        follows it).
    """
    k, t = drafts.shape
    ids = np.asarray(input_ids).reshape(-1)
    mask = np.asarray(loss_mask).reshape(-1).astype(bool)
    doc = np.asarray(document_ids).reshape(-1)
    if not (len(ids) == len(mask) == len(doc) == t):
        raise ValueError(f"drafts cover {t} rows, input_ids {len(ids)}, loss_mask {len(mask)}, document_ids {len(doc)}")
    rows = np.arange(t)
    alive = np.ones(t, dtype=bool)
    accepted = np.zeros(t, dtype=np.int64)
    for j in range(k):
        nxt = rows + 1 + j
        ok = nxt < t
        n = np.minimum(nxt, t - 1)
        ok &= (doc[n] == doc) & mask[n] & (drafts[j] == ids[n])
        alive &= ok
        accepted += alive
    n1 = np.minimum(rows + 1, t - 1)
    anchors = mask & (rows + 1 < t) & (doc[n1] == doc) & mask[n1] & (doc >= 0)
    return accepted, anchors


def replay_decoding(accepted: np.ndarray, anchors: np.ndarray, document_ids: np.ndarray, k: int, max_tokens: int | None = None) -> dict:
    """Walk each sample as vLLM's greedy speculative decoding would and count its drafts.

    Per sample: the first draft is made at its first anchor (the target emitted the first
    answer token in prefill), ``accepted[i]`` tokens are taken, the target adds one, and
    the next draft is made at row ``i + accepted[i] + 1``; the walk ends at a row that is not
    an anchor (the answer's last token) or once ``max_tokens`` answer tokens are emitted
    (``evaluation.max_tokens``; ``None``: the whole answer).

    Returns:
        counters in :func:`eagle3_pipeline.evaluation.spec_decode_counters`' form
        (``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``,
        ``accepted_per_position`` of length ``k``), for
        :func:`eagle3_pipeline.evaluation.acceptance_report`.
    """
    doc = np.asarray(document_ids).reshape(-1)
    acc = np.asarray(accepted).reshape(-1)
    anc = np.asarray(anchors).reshape(-1).astype(bool)
    per_pos = np.zeros(k, dtype=np.int64)
    drafts = 0
    rows = np.flatnonzero(anc)
    _, first = np.unique(doc[rows], return_index=True)  # each sample's first anchor
    for s in rows[first]:
        i, emitted = int(s), 1
        while i < len(anc) and anc[i] and doc[i] == doc[s] and (max_tokens is None or emitted < max_tokens):
            a = int(min(acc[i], k))
            drafts += 1
            per_pos[:a] += 1
            i += a + 1
            emitted += a + 1
    return {
        "num_drafts": drafts,
        "num_draft_tokens": drafts * k,
        "num_accepted_tokens": int(per_pos.sum()),
        "accepted_per_position": per_pos.tolist(),
    }


def token_weighted_accuracy(accepted: np.ndarray, anchors: np.ndarray, k: int) -> list[float]:
    """Fraction of all anchors whose first ``j + 1`` drafts are right, ``j = 0..k-1``.

    speculators' ``full_acc_j`` counted against the tokens the target emitted (speculators
    itself compares with the target's argmax over the draft vocabulary).
    """
    a = np.asarray(accepted).reshape(-1)[np.asarray(anchors).reshape(-1).astype(bool)]
    if a.size == 0:
        return [0.0] * k
    return [float((a > j).mean()) for j in range(k)]


def add_counters(a: dict | None, b: dict) -> dict:
    """Sum two counter dicts of :func:`replay_decoding` (``a`` may be ``None``)."""
    if a is None:
        return {key: (list(v) if isinstance(v, list) else v) for key, v in b.items()}
    pp = [x + y for x, y in zip(a["accepted_per_position"], b["accepted_per_position"], strict=True)]
    return {key: a[key] + b[key] for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")} | {"accepted_per_position": pp}
