"""Replaying speculative decoding offline (eagle3_pipeline.acceptance) against a real draft-and-verify loop."""

import random

import numpy as np
import pytest
import torch

from eagle3_pipeline.acceptance import accepted_lengths, add_counters, draft_target_ids, replay_decoding, token_weighted_accuracy
from eagle3_pipeline.evaluation import acceptance_report

VOCAB = 7


def _target(prefix: tuple) -> int:
    """A deterministic greedy 'target': next token from the last two."""
    return (3 * prefix[-1] + prefix[-2] + len(prefix) // 5) % VOCAB


def _drafter(seed: int):
    """A deterministic 'drafter' that agrees with the target on some contexts only."""
    table: dict = {}
    rng = random.Random(seed)

    def f(prefix: tuple) -> int:
        key = (prefix[-2], prefix[-1], len(prefix) // 5)
        if key not in table:
            table[key] = _target(prefix) if rng.random() < 0.7 else rng.randrange(VOCAB)
        return table[key]

    return f


def _speculative_loop(prompt: list[int], answer_len: int, drafter, k: int, max_tokens: int | None) -> tuple[list[int], dict]:
    """Greedy speculative decoding as vLLM runs it: draft k from the last emitted token, verify, emit accepted + 1."""
    seq = list(prompt) + [_target(tuple(prompt))]  # prefill emits the first answer token
    drafts, per_pos = 0, [0] * k
    limit = answer_len if max_tokens is None else min(answer_len, max_tokens)
    while len(seq) - len(prompt) < limit:
        # the drafter runs autoregressively on its own proposals
        prop, ctx = [], tuple(seq)
        for _ in range(k):
            t = drafter(ctx)
            prop.append(t)
            ctx = ctx + (t,)
        drafts += 1
        a = 0
        for t in prop:
            # the answer ends at answer_len tokens: a draft past the end is not accepted
            if len(seq) - len(prompt) >= answer_len or t != _target(tuple(seq)):
                break
            seq.append(t)
            a += 1
        for j in range(a):
            per_pos[j] += 1
        if len(seq) - len(prompt) < answer_len:
            seq.append(_target(tuple(seq)))  # the target's own token after the accepted ones
    return seq, {
        "num_drafts": drafts,
        "num_draft_tokens": drafts * k,
        "num_accepted_tokens": sum(per_pos),
        "accepted_per_position": per_pos,
    }


def _teacher_forced_rows(prompt: list[int], answer: list[int], drafter, k: int):
    """speculators' TTT drafts on the shifted rows: step j at row i guesses input_ids[i + 1 + j] from the true prefix."""
    full = prompt + answer
    ids = np.array(full[1:])  # shift_batch drops the first token
    mask = np.array([0] * (len(prompt) - 1) + [1] * len(answer), dtype=bool)
    drafts = np.zeros((k, len(ids)), dtype=np.int64)
    for i in range(len(ids)):
        for j in range(k):
            drafts[j, i] = drafter(tuple(full[: i + 2 + j]))  # true tokens up to row i + j
    return ids, mask, drafts


@pytest.mark.parametrize("k,max_tokens", [(1, None), (3, None), (3, 12), (5, None)])
def test_replay_counts_what_a_draft_and_verify_loop_counts(k, max_tokens):
    total_loop, total_replay, ids_all, mask_all, doc_all, drafts_all = None, None, [], [], [], []
    for doc in range(6):
        prompt = [doc % VOCAB, (doc * 3 + 1) % VOCAB, 2, 5]
        answer_len = 20 + 7 * doc
        drafter = _drafter(doc)
        seq, loop = _speculative_loop(prompt, answer_len, drafter, k, max_tokens)
        # the target's greedy answer, as a trace would hold it
        full = list(prompt)
        while len(full) - len(prompt) < answer_len:
            full.append(_target(tuple(full)))
        assert seq[: len(seq)] == full[: len(seq)]
        ids, mask, drafts = _teacher_forced_rows(prompt, full[len(prompt) :], drafter, k)
        acc, anchors = accepted_lengths(drafts, ids, mask, np.full(len(ids), doc))
        replay = replay_decoding(acc, anchors, np.full(len(ids), doc), k, max_tokens)
        assert replay == loop, f"sample {doc}"
        total_loop = add_counters(total_loop, loop)
        ids_all.append(ids)
        mask_all.append(mask)
        doc_all.append(np.full(len(ids), doc))
        drafts_all.append(drafts)
    # the same samples packed into one batch with padding between them give the same totals
    pad = 3
    cat = lambda parts, fill: np.concatenate([np.r_[p, np.full(pad, fill, dtype=p.dtype)] for p in parts])  # noqa: E731
    ids, mask, doc = cat(ids_all, 0), cat(mask_all, False), cat(doc_all, -1)
    drafts = np.concatenate([np.c_[d, np.zeros((k, pad), dtype=np.int64)] for d in drafts_all], axis=1)
    acc, anchors = accepted_lengths(drafts, ids, mask, doc)
    total_replay = replay_decoding(acc, anchors, doc, k, max_tokens)
    assert total_replay == total_loop
    assert acceptance_report(total_replay, k)["acceptance_length"] > 1.0


def test_token_weighted_accuracy_counts_every_anchor():
    # rows 0..5 of one sample, all generated; drafts right at rows 0, 1, 3 for step 0
    ids = np.array([10, 11, 12, 13, 14, 15])
    drafts = np.array([[11, 12, 0, 14, 0, 0], [12, 0, 0, 15, 0, 0]])
    acc, anchors = accepted_lengths(drafts, ids, np.ones(6, bool), np.zeros(6, int))
    assert acc.tolist() == [2, 1, 0, 2, 0, 0]  # row 3: steps guess 14, 15; row 4: guesses 0 for 15
    assert anchors.tolist() == [True] * 5 + [False]  # the last row has no next token
    assert token_weighted_accuracy(acc, anchors, 2) == [3 / 5, 2 / 5]
    # the walk drafts at rows 0 (takes 2, jumps to 3), 3 (takes 2, jumps to 6: past the end)
    assert replay_decoding(acc, anchors, np.zeros(6, int), 2)["accepted_per_position"] == [2, 2]
    assert replay_decoding(acc, anchors, np.zeros(6, int), 2)["num_drafts"] == 2


def test_prompt_rows_and_other_samples_are_never_accepted():
    ids = np.array([5, 6, 7, 8, 9])
    mask = np.array([0, 1, 1, 1, 1], bool)  # row 0 is a prompt token
    doc = np.array([0, 0, 0, 1, 1])  # rows 3-4 are another sample
    drafts = np.array([[6, 7, 8, 9, 0]])  # each right, but row 2's guess is the next sample's token
    acc, anchors = accepted_lengths(drafts, ids, mask, doc)
    assert acc.tolist() == [1, 1, 0, 1, 0]
    assert anchors.tolist() == [False, True, False, True, False]


def test_draft_target_ids_applies_d2t_offsets():
    d2t = np.array([0, 2, 5], dtype=np.int64)  # draft 0 -> 0, 1 -> 3, 2 -> 7
    out = draft_target_ids([torch.tensor([[0, 1, 2]]), torch.tensor([[2, 2, 1]])], d2t)
    assert out.tolist() == [[0, 3, 7], [7, 7, 3]]


def test_mismatched_lengths_are_an_error():
    with pytest.raises(ValueError, match="drafts cover 3 rows"):
        accepted_lengths(np.zeros((1, 3), np.int64), np.zeros(4, np.int64), np.ones(4, bool), np.zeros(4, int))
