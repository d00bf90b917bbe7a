import numpy as np
import pytest
import torch
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

from eagle3_pipeline.io import InputError
from eagle3_pipeline.vocab import build_mapping, count_supervised_tokens, coverage_report, load_mapping, mapping_problem


def independent_mapping(counts: np.ndarray, n: int):
    """The convention written out independently: top-n by (-freq, id), pad lowest unused ids, sort."""
    ids = [int(i) for i in np.flatnonzero(counts)]
    ids.sort(key=lambda i: (-int(counts[i]), i))
    chosen = ids[:n]
    pad = (i for i in range(len(counts)) if i not in set(chosen))
    while len(chosen) < n:
        chosen.append(next(pad))
    chosen.sort()
    d2t = np.array(chosen) - np.arange(n)
    t2d = np.zeros(len(counts), dtype=bool)
    t2d[chosen] = True
    return d2t, t2d


def test_counts_only_given_tokens():
    c = count_supervised_tokens([[5, 5, 7], [7, 9], []], 10)
    assert c.tolist() == [0, 0, 0, 0, 0, 2, 0, 2, 0, 1]


def test_count_rejects_foreign_ids():
    with pytest.raises(InputError, match="token id 10 outside the target vocabulary"):
        count_supervised_tokens([[10]], 10)
    with pytest.raises(InputError, match="token id -1 outside the target vocabulary"):
        count_supervised_tokens([[3], [-1]], 10, batch_tokens=1)


@pytest.mark.parametrize("batch_tokens", [1, 7, 1 << 22])
def test_batched_counting_equals_a_per_token_count(batch_tokens):
    rng = np.random.default_rng(3)
    samples = [rng.integers(0, 1000, size=int(n)).tolist() for n in rng.integers(0, 50, size=200)]
    want = np.zeros(1000, dtype=np.int64)
    for ids in samples:
        for t in ids:
            want[t] += 1
    assert np.array_equal(count_supervised_tokens(samples, 1000, batch_tokens=batch_tokens), want)


def test_exact_mapping_with_ties_and_padding():
    counts = np.zeros(20, dtype=np.int64)
    counts[[3, 17, 9, 12]] = [5, 5, 2, 7]  # 3 and 17 tie: 3 wins
    d2t, t2d = build_mapping(counts, 3)
    assert (np.arange(3) + d2t).tolist() == [3, 12, 17]  # top-3: 12 (7), 3 (5), 17 (5)
    d2t, t2d = build_mapping(counts, 2)
    assert (np.arange(2) + d2t).tolist() == [3, 12]  # tie 3/17 broken by lower id
    # larger than the distinct tokens: pad with the lowest unused ids (0, 1, 2)
    d2t, t2d = build_mapping(counts, 7)
    assert (np.arange(7) + d2t).tolist() == [0, 1, 2, 3, 9, 12, 17]
    assert t2d.sum() == 7 and t2d.dtype == np.bool_ and d2t.dtype == np.int64


def test_bit_identical_to_speculators_and_independent_rule():
    rng = np.random.default_rng(0)
    v, n = 5000, 700
    counts = np.zeros(v, dtype=np.int64)
    idx = rng.choice(v, 1500, replace=False)
    counts[idx] = rng.integers(1, 40, size=1500)  # many ties
    d2t, t2d = build_mapping(counts, n)
    freq = {int(i): int(counts[i]) for i in np.flatnonzero(counts)}
    ref_d2t, ref_t2d = build_vocab_mappings_from_distribution(freq, n, v)
    assert torch.equal(torch.from_numpy(d2t), ref_d2t)
    assert torch.equal(torch.from_numpy(t2d), ref_t2d)
    ind_d2t, ind_t2d = independent_mapping(counts, n)
    assert np.array_equal(d2t, ind_d2t) and np.array_equal(t2d, ind_t2d)


def test_draft_vocab_larger_than_target_is_an_error():
    with pytest.raises(InputError, match="between 1 and the target vocabulary size 10"):
        build_mapping(np.ones(10, dtype=np.int64), 11)


def test_coverage_report():
    counts = np.array([0, 6, 3, 1, 0], dtype=np.int64)
    d2t, t2d = build_mapping(counts, 2)
    rep = coverage_report(counts, t2d, 2)
    assert rep["coverage"] == pytest.approx(0.9)
    assert rep["distinct_supervised_tokens"] == 3
    ladder = {x["draft_vocab_size"]: x["coverage"] for x in rep["ladder"]}
    assert ladder[2] == pytest.approx(0.9) and ladder[5] == pytest.approx(1.0)
    assert [x["draft_vocab_size"] for x in rep["ladder"]] == sorted(ladder)


def test_no_supervised_tokens_is_an_error():
    with pytest.raises(InputError, match="no supervised tokens"):
        build_mapping(np.zeros(10, dtype=np.int64), 4)


def test_the_vocab_counts_only_trace_shards_with_the_bytes_generation_recorded(tmp_path):
    import json

    from eagle3_pipeline.io import file_stat, sha256_file
    from eagle3_pipeline.vocab import recorded_completions

    shard = tmp_path / "shard-00000.jsonl"
    shard.write_text("".join(json.dumps({"id": str(i), "completion_token_ids": [504, 7, i]}) + "\n" for i in range(3)))
    summary = tmp_path / "shard-00000.summary.json"
    summary.write_text(json.dumps({"traces_sha256": sha256_file(shard), "traces_stat": file_stat(shard)}))
    assert list(recorded_completions([shard])) == [[504, 7, 0], [504, 7, 1], [504, 7, 2]]
    # one token id changed after generation finished (same length, so only the bytes tell)
    shard.write_text(shard.read_text().replace("504", "501", 1))
    with pytest.raises(InputError, match=r"shard-00000\.jsonl: its bytes differ from what its producer recorded"):
        list(recorded_completions([shard]))


def test_a_draft_vocabulary_changed_on_disk_is_refused_before_training_reads_it(tmp_path):
    """speculators' own builder's mapping passes; a flipped bit in d2t.npy (the value a corrupted
    file gave, 2**34 + 46: vLLM's engine died on it as an index error), two draft ids on one target
    id, and a t2d that marks other ids are each named with the entry at fault."""
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, size=1000)
    d2t, t2d = build_mapping(counts, 64)  # speculators' builder
    assert mapping_problem(d2t, t2d) is None
    np.save(tmp_path / "d2t.npy", d2t)
    np.save(tmp_path / "t2d.npy", t2d)
    got_d2t, got_t2d = load_mapping(tmp_path)
    assert np.array_equal(got_d2t, d2t) and np.array_equal(got_t2d, t2d)
    ids = np.flatnonzero(t2d)  # the target ids, independently: t2d's true entries
    bad = d2t.copy()
    bad[7] ^= 1 << 34
    np.save(tmp_path / "d2t.npy", bad)
    with pytest.raises(InputError) as e:
        load_mapping(tmp_path)
    assert f"d2t[7] = {int(bad[7])} maps draft id 7 to target id {7 + int(bad[7])}, outside the target vocabulary of 1000" in str(e.value)
    assert str(e.value).startswith(f"{tmp_path}: not a draft vocabulary") and f"--forcerun {tmp_path / 'd2t.npy'}" in str(e.value)
    twice = d2t.copy()
    twice[5] = ids[4] - 5  # draft ids 4 and 5 on one target id
    assert mapping_problem(twice, t2d) == f"d2t[5] = {int(twice[5])} maps draft id 5 to target id {ids[4]}, not above draft id 4's {ids[4]}"
    other = t2d.copy()
    other[ids[0]], other[np.flatnonzero(~t2d)[0]] = False, True  # as many ids marked, one of them another
    assert mapping_problem(d2t, other) == "t2d marks 64 target ids, not the 64 that d2t maps to"
    assert "not int [N] and bool [V]" in mapping_problem(d2t.astype(np.float32), t2d)


def test_draft_to_target_is_the_offset_convention_speculators_builds():
    """d2t holds offsets: draft index i is target id i + d2t[i]. Checked on a hand-made mapping and
    against the target ids speculators' builder marks in t2d, for every draft index and for a
    [k, T] array of drafts."""
    from eagle3_pipeline.conventions import draft_to_target

    targets = np.array([3, 7, 9])
    d2t = targets - np.arange(3)  # [3, 6, 7]
    assert draft_to_target(d2t).tolist() == [3, 7, 9]
    assert draft_to_target(d2t, np.array([[2, 0], [1, 1]])).tolist() == [[9, 3], [7, 7]]
    d2t, t2d = build_vocab_mappings_from_distribution({4: 5, 11: 9, 12: 1, 30: 7, 49: 3}, 4, 50)
    assert draft_to_target(d2t.numpy()).tolist() == np.flatnonzero(t2d.numpy()).tolist() == [4, 11, 30, 49]
    with pytest.raises(IndexError):
        draft_to_target(np.array([0, 1]), np.array([2]))
