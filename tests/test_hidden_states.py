"""Hidden-state extraction on the real SmolLM2 target against independent transformers forwards."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3_pipeline.conventions import loss_mask, resolve_layer_ids
from eagle3_pipeline.hf_backend import extract_hf, load_hf_target, make_batches
from eagle3_pipeline.shards import Sample, ShardReader, sample_from_trace, write_shard


@pytest.fixture(scope="module")
def model(target_dir):
    return load_hf_target(str(target_dir), "cpu")


@pytest.fixture(scope="module")
def samples(tokenizer):
    out = []
    for i, (q, a) in enumerate(
        [
            ("Name a color.", "Blue."),
            ("What is 2+2? Explain step by step.", "2 plus 2 equals 4, because adding two and two gives four."),
            ("Hi", "Hello! How can I help you today?"),
        ]
    ):
        p = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)["input_ids"]
        c = tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append(Sample(f"s{i}", np.array(p + c, dtype=np.int64), loss_mask(len(p), len(c))))
    return out


def test_the_forwards_leave_cudnn_attention_out_unless_asked(model, samples):
    """prefill_batches runs each forward with cuDNN's attention disabled (its per-shape plans cost
    more than its kernels save on a job's padded batches), restores torch's setting after it, and
    allows it where the caller passes backends that include it; the states do not change on a CPU."""
    from eagle3_pipeline.hf_backend import attention_backends, prefill_batches

    seen = []
    hook = model.model.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    try:
        before = torch.backends.cuda.cudnn_sdp_enabled()
        runs = {}
        for cudnn in (False, True):
            seen.clear()
            hbs = prefill_batches(
                model,
                samples,
                [1, 2],
                batch_tokens=40,
                storage_dtype=torch.float32,
                backends=attention_backends(cudnn=cudnn) if cudnn else None,
            )
            runs[cudnn] = [x.clone() for hb in hbs for _, x in hb.rows()]
            assert seen == [cudnn] * len(make_batches([len(s.input_ids) for s in samples], 40)) and len(seen) > 1
            assert torch.backends.cuda.cudnn_sdp_enabled() == before
    finally:
        hook.remove()
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True], strict=True))


def test_make_batches_groups_by_length():
    assert make_batches([5, 100, 7, 90], 200) == [[1, 3], [2, 0]]
    assert make_batches([300, 10], 200) == [[0], [1]]  # oversize sample alone


def test_states_equal_independent_forward_at_every_layer_id(model, samples):
    n = model.config.num_hidden_layers
    _, layer_ids = resolve_layer_ids([0, 2, 15, 27], n)
    states = extract_hf(model, samples, layer_ids, batch_tokens=1, storage_dtype=torch.float32)  # batch size 1
    for s, st in zip(samples, states, strict=True):
        ids = torch.from_numpy(s.input_ids)[None]
        with torch.no_grad():
            ref = model(input_ids=ids, output_hidden_states=True)
        assert st.shape == (len(s.input_ids), len(layer_ids), model.config.hidden_size)
        for j, k in enumerate(layer_ids[:-1]):
            assert torch.equal(st[:, j], ref.hidden_states[k][0].float()), f"layer id {k}"
        # id n: the last layer's output *before* the final norm; transformers 5 gives the
        # post-norm state at output_hidden_states[n], so check norm(captured) == that.
        final = st[:, -1].to(model.dtype)
        assert not torch.equal(final, ref.hidden_states[n][0])
        assert torch.equal(model.model.norm(final[None])[0], ref.hidden_states[n][0])


def test_batched_equals_batch_size_one(model, samples):
    _, layer_ids = resolve_layer_ids(None, model.config.num_hidden_layers)
    one = extract_hf(model, samples, layer_ids, batch_tokens=1, storage_dtype=torch.float32)
    many = extract_hf(model, samples, layer_ids, batch_tokens=10_000, storage_dtype=torch.float32)
    assert len(make_batches([len(s.input_ids) for s in samples], 10_000)) == 1
    for a, b in zip(one, many, strict=True):
        # bf16 model: different batch shapes change matmul blocking, so equality is
        # within bf16 rounding of the residual stream magnitude, not bitwise.
        scale = a.abs().amax(dim=(0, 2), keepdim=True)
        assert ((a - b).abs() <= 0.02 * scale).all()


def test_nan_states_name_the_sample(target_dir, samples):
    m = load_hf_target(str(target_dir), "cpu")
    with torch.no_grad():
        m.model.layers[3].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="sample s1"):
        extract_hf(m, samples[1:2], [2, 30], batch_tokens=100, storage_dtype=torch.bfloat16)


def test_shard_roundtrip(tmp_path, model, samples):
    aux, layer_ids = resolve_layer_ids(None, model.config.num_hidden_layers)
    states = extract_hf(model, samples, layer_ids, batch_tokens=4096, storage_dtype=torch.bfloat16)
    index = write_shard(
        tmp_path / "shard-00000.safetensors",
        samples,
        states,
        layer_ids=layer_ids,
        aux_layer_ids=aux,
        index_path=tmp_path / "shard-00000.index.json",
    )
    assert index["num_samples"] == 3 and index["num_tokens"] == sum(len(s.input_ids) for s in samples)
    assert not list(tmp_path.glob(".*tmp"))  # no temporary files left behind
    r = ShardReader(tmp_path / "shard-00000.safetensors")
    assert r.layer_ids == [2, 15, 27, 30] and r.aux_layer_ids == [2, 15, 27]
    for i, s in enumerate(samples):
        got = r.sample(i)
        assert got["id"] == s.id
        assert got["input_ids"].tolist() == s.input_ids.tolist()
        assert got["loss_mask"].tolist() == s.loss_mask.tolist()
        assert torch.equal(got["hidden_states"], states[i])
    # the in-place writer's file is what safetensors itself writes for these tensors: same
    # tensors and metadata when safetensors reads it back, same size (no holes or padding)
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    ours = tmp_path / "shard-00000.safetensors"
    with safe_open(str(ours), "pt") as f:
        meta = f.metadata()
    want = {
        "input_ids": torch.from_numpy(np.concatenate([s.input_ids for s in samples])),
        "loss_mask": torch.from_numpy(np.concatenate([s.loss_mask for s in samples])),
        "offsets": torch.tensor([0, *np.cumsum([len(s.input_ids) for s in samples])], dtype=torch.int64),
        "hidden_states": torch.cat(states),
    }
    save_file(want, str(tmp_path / "reference.safetensors"), metadata=meta)
    got = load_file(str(ours))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert ours.stat().st_size == (tmp_path / "reference.safetensors").stat().st_size
    assert json.loads(meta["eagle3_pipeline"])["sample_ids"] == [s.id for s in samples]


def _wait_until(cond, what: str, timeout_s: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize(
    "dtype,hidden",
    [(torch.bfloat16, 8), (torch.float8_e4m3fn, 8), (torch.float8_e4m3fn, 3)],
    ids=["bf16", "fp8", "fp8-scales-first"],
)
def test_a_shard_hashed_while_it_is_filled_has_the_sha256_of_its_finished_bytes(tmp_path, dtype, hidden):
    """Chunks filled out of order (the second first): the hasher reads no byte of a row that is not
    final yet, reaches the end of the done chunks that are contiguous from row 0 while the others are
    written, and its digest is hashlib's over the finished file. The byte offsets are computed here
    from the file's own safetensors header. An fp8 shard whose states take 35 x 2 x 3 bytes (not a
    multiple of 4) stores its float32 scales before the states; of hidden size 8, after them."""
    import hashlib

    from eagle3_pipeline.shards import ShardHasher, ShardWriter, row_bytes

    rng = np.random.default_rng(3)
    lengths = [5, 9, 4, 7, 6, 4]  # 35 tokens: 35 x 2 x 3 fp8 bytes of states, not a multiple of 4
    samples = [Sample(f"s{i}", rng.integers(0, 1000, n).astype(np.int64), rng.random(n) < 0.5) for i, n in enumerate(lengths)]
    rows = np.cumsum([0, *lengths]).tolist()
    chunk_rows = [(rows[a], rows[b]) for a, b in ((0, 2), (2, 4), (4, 6))]
    path = tmp_path / "shard.safetensors"
    w = ShardWriter.create(path, samples, layer_ids=[1, 3], aux_layer_ids=[1], hidden_size=hidden, storage_dtype=dtype)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    filled = sorted((header[k]["data_offsets"], k) for k in ("hidden_states", "hidden_states_scale") if k in header)
    (first, last), name = filled[0]
    assert name == ("hidden_states_scale" if hidden == 3 else "hidden_states")
    assert row_bytes(header, "hidden_states") == 2 * hidden * dtype.itemsize  # [T, 2 layers, hidden] of dtype
    if "hidden_states_scale" in header:
        assert row_bytes(header, "hidden_states_scale") == 2 * 4  # [T, 2 layers] float32
    start, row_bytes = 8 + n + first, (last - first) // rows[-1]
    states = torch.randn(rows[-1], 2, hidden)
    done: set[int] = set()
    hasher = ShardHasher(path, chunk_rows)
    with hasher.following(lambda: set(done), poll_s=0.005):
        _wait_until(lambda: hasher.hashed == start, "the header and small tensors were not hashed")
        for k, want in ((1, start), (0, start + rows[4] * row_bytes), (2, path.stat().st_size)):
            a, b = chunk_rows[k]
            w.write_states(a, states[a:b])
            done.add(k)
            _wait_until(lambda want=want: hasher.hashed == want, f"after chunk {k}: {hasher.hashed} bytes hashed, not {want}")
        digest = hasher.hexdigest()
    w.close()
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert hasher.tail_seconds >= 0 and hasher.hashed == path.stat().st_size
    r = ShardReader(path)  # the layout reads back, scales first or last
    for i in range(len(samples)):
        want = states[rows[i] : rows[i + 1]].to(torch.bfloat16).float()
        assert torch.allclose(r.sample(i)["hidden_states"].float(), want, rtol=2**-3, atol=1e-6), i


def test_the_shard_hasher_names_chunks_that_do_not_cover_the_rows_and_a_file_cut_short(tmp_path):
    from eagle3_pipeline.shards import ShardHasher, ShardWriter

    samples = [Sample(f"s{i}", np.arange(4, dtype=np.int64), np.array([0, 1, 1, 1], bool)) for i in range(2)]
    path = tmp_path / "shard.safetensors"
    ShardWriter.create(path, samples, layer_ids=[1, 3], aux_layer_ids=[1], hidden_size=8, storage_dtype=torch.bfloat16).close()
    with pytest.raises(ValueError, match="do not cover its 8 rows"):
        ShardHasher(path, [(0, 4), (5, 8)])
    hasher = ShardHasher(path, [(0, 4), (4, 8)])
    os.truncate(path, 100)
    with pytest.raises(OSError, match=r"shard.safetensors: 100 bytes, not the \d+ its header gives"):
        hasher.hexdigest()
    ShardWriter.create(path, samples, layer_ids=[1, 3], aux_layer_ids=[1], hidden_size=8, storage_dtype=torch.bfloat16).close()
    size = path.stat().st_size
    os.truncate(path, size - 10)  # its header intact
    with pytest.raises(ValueError, match=f"shard.safetensors: {size - 10} bytes, not the {size} its header gives"):
        ShardHasher(path, [(0, 4), (4, 8)])


def test_a_shard_of_no_samples_is_hashed_as_written(tmp_path):
    """A trace shard whose answers were all rejected gives a shard of no samples and no chunks."""
    import hashlib

    from eagle3_pipeline.shards import ShardHasher, ShardWriter

    path = tmp_path / "empty.safetensors"
    ShardWriter.create(path, [], layer_ids=[1, 3], aux_layer_ids=[1], hidden_size=8, storage_dtype=torch.bfloat16).close()
    with ShardHasher(path, []).following(list) as hasher:
        assert hasher.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_trace_shard_with_no_answers_gives_an_empty_hidden_state_shard(tmp_path, target_dir):
    """Generation can reject every answer of a shard; extraction then writes a shard of no samples
    (no engine starts) with its index and the SHA-256 of its bytes."""
    import hashlib

    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.hidden_states import run_extraction_shard

    (tmp_path / "traces.jsonl").write_text("")
    cfg = validate_config({"extraction": {"chunk_samples": 2}})["extraction"] | {"data_parallel_size": 1, "gpus_per_replica": 1}
    out = tmp_path / "shard-00000.safetensors"
    index = run_extraction_shard(
        str(tmp_path / "traces.jsonl"), str(out), str(tmp_path / "shard-00000.index.json"), str(target_dir), cfg,
        max_seq_len=2048, trust_remote_code=False, host_lock_enabled=False,
    )  # fmt: skip
    assert (index["num_samples"], index["num_tokens"], index["chunks"]) == (0, 0, 0)
    assert index["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert len(ShardReader(out)) == 0


def test_a_kept_partial_shard_cut_short_is_made_again_and_its_done_chunks_dropped(tmp_path, caplog):
    """A partial shard kept from a killed job whose file lost its end (its header intact) would
    resume with rows of done chunks missing; it is discarded like one of another layout."""
    from eagle3_pipeline.resume import ChunkStore
    from eagle3_pipeline.shards import DONE_SUFFIX, ShardWriter, mark_chunk_done, prepare_partial_shard

    samples = [Sample(f"s{i}", np.arange(4, dtype=np.int64), np.array([0, 1, 1, 1], bool)) for i in range(2)]
    layout = {"layer_ids": [1, 3], "aux_layer_ids": [1], "hidden_size": 8, "storage_dtype": torch.bfloat16}
    store = ChunkStore(tmp_path / "shard-00000.safetensors", "fp", DONE_SUFFIX)
    path = prepare_partial_shard(store, samples, **layout)
    size = path.stat().st_size
    with ShardWriter.open(path) as w:
        mark_chunk_done(store.path(0), [w.write_states(0, torch.ones(4, 2, 8))])
    assert prepare_partial_shard(store, samples, **layout) == path and store.finished() == [0]  # kept as it is
    os.truncate(path, size - 10)
    with caplog.at_level("WARNING"):
        assert prepare_partial_shard(store, samples, **layout) == path
    assert path.stat().st_size == size and store.finished() == []
    assert "discarding 1 done chunk(s)" in caplog.text


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_done_chunk_whose_rows_changed_after_its_marker_is_extracted_again(tmp_path, dtype, caplog):
    """Each done marker records the CRC-32 of every write of its chunk; a kept partial shard's
    done chunk whose bytes differ now (one flipped byte, in the states or in an fp8 shard's
    scales) or whose marker records no rows (an earlier version's) loses its marker, and only it."""
    import zlib

    from eagle3_pipeline.resume import ChunkStore
    from eagle3_pipeline.shards import (
        DONE_SUFFIX,
        FP8,
        STORAGE_DTYPES,
        ShardWriter,
        check_done_chunks,
        mark_chunk_done,
        prepare_partial_shard,
        quantize_fp8,
        read_shard_header,
    )

    lengths = [5, 3, 4, 6, 2, 4]  # chunks of two samples: rows 0-7, 8-17, 18-23
    samples = [Sample(f"s{i}", np.arange(n, dtype=np.int64), np.ones(n, bool)) for i, n in enumerate(lengths)]
    rows = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    storage = STORAGE_DTYPES[dtype]
    layout = {"layer_ids": [1, 3], "aux_layer_ids": [1], "hidden_size": 8, "storage_dtype": storage}
    g = torch.Generator().manual_seed(0)
    states = [torch.randn(n, 2, 8, generator=g) for n in lengths]
    store = ChunkStore(tmp_path / "shard-00000.safetensors", "fp", DONE_SUFFIX)
    path = prepare_partial_shard(store, samples, **layout)
    with ShardWriter.open(path) as w:
        for c in range(3):
            mark_chunk_done(store.path(c), [w.write_states(rows[i], states[i]) for i in (2 * c + 1, 2 * c)])  # any order
    # the marker's CRC is zlib's over the bytes stored: the cast states, then an fp8 shard's scales
    x, scale = quantize_fp8(states[3]) if storage == FP8 else (states[3].to(storage), None)
    want = zlib.crc32(x.view(torch.uint8).numpy())
    want = zlib.crc32(scale.numpy().tobytes(), want) if scale is not None else want
    marker = json.loads(store.path(1).read_text())
    assert marker == {"samples": 2, "tokens": 10, "rows": [[rows[2], 4, marker["rows"][0][2]], [rows[3], 6, want]]}
    assert check_done_chunks(store, path) == {}

    prefix, header = read_shard_header(path)
    tensor = "hidden_states_scale" if storage == FP8 else "hidden_states"
    a, b = header[tensor]["data_offsets"]
    flip = len(prefix) + a + (rows[3] + 2) * (b - a) // sum(lengths)  # sample s3's third row, chunk 1
    with open(path, "r+b") as f:
        f.seek(flip)
        byte = f.read(1)
        f.seek(flip)
        f.write(bytes([byte[0] ^ 0x10]))
    store.path(2).write_text(json.dumps({"samples": 2, "tokens": 6}) + "\n")  # no rows recorded
    with caplog.at_level("INFO"):
        assert prepare_partial_shard(store, samples, **layout) == path
    assert store.finished() == [0]
    assert f"done chunk 1 is extracted again: rows {rows[3]}-{rows[4] - 1} have CRC-32" in caplog.text
    assert f"not the {want:08x} written" in caplog.text
    assert "done chunk 2 is extracted again: chunk-000002.done does not record its rows' CRC-32" in caplog.text
    assert "3 done chunk(s) of the kept partial shard checked" in caplog.text


def test_sample_from_trace_limits():
    t = {"id": "x", "prompt_token_ids": [1, 2, 3], "completion_token_ids": [4, 5]}
    s = sample_from_trace(t, 5)
    assert s.input_ids.tolist() == [1, 2, 3, 4, 5] and s.loss_mask.tolist() == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="trace x: 5 tokens exceed max_seq_len=4"):
        sample_from_trace(t, 4)
    with pytest.raises(ValueError, match="trace x: empty completion"):
        sample_from_trace({**t, "completion_token_ids": []}, 5)


@pytest.mark.processes
def test_equal_shards_have_equal_bytes_across_processes(tmp_path):
    """safetensors keeps string metadata in a hash map whose order varies by process;
    the shard's single metadata key makes equal content give an equal file (SHA-256)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import sys
        import numpy as np, torch
        from eagle3_pipeline.shards import Sample, write_shard
        s = [Sample("a", np.arange(5, dtype=np.int64), np.array([0, 0, 1, 1, 1], dtype=bool))]
        h = [torch.arange(5 * 2 * 3, dtype=torch.float32).reshape(5, 2, 3).to(torch.bfloat16)]
        idx = write_shard(sys.argv[1], s, h, layer_ids=[1, 4], aux_layer_ids=[1], index_path=None)
        print(idx["sha256"])
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "workflow_scripts")}
    shas = {
        subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / f"s{i}.safetensors")], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        for i in range(4)
    }
    assert len(shas) == 1


def test_fp8_storage_round_trip_error_is_bounded(tmp_path, target_dir):
    """Real SmolLM2 states stored as float8 e4m3fn with per-(token, layer) scales: half the
    bytes of bf16, each element within half an e4m3 step (2^-4 relative to the row maximum's
    binade) of the bf16 value, and a shard filled in parts equals one written at once."""

    model = load_hf_target(str(target_dir), "cpu")
    rng = np.random.default_rng(5)
    samples = [
        sample_from_trace(
            {
                "id": f"s{i}",
                "prompt_token_ids": rng.integers(1, 49152, 12).tolist(),
                "completion_token_ids": rng.integers(1, 49152, 20).tolist(),
            },
            2048,
        )
        for i in range(4)
    ]
    _, layer_ids = resolve_layer_ids(None, 30)
    states = extract_hf(model, samples, layer_ids, batch_tokens=4096, storage_dtype=torch.bfloat16)
    bf = write_shard(tmp_path / "bf16.safetensors", samples, states, layer_ids=layer_ids, aux_layer_ids=layer_ids[:-1], index_path=None)
    f8 = write_shard(
        tmp_path / "fp8.safetensors",
        samples,
        states,
        layer_ids=layer_ids,
        aux_layer_ids=layer_ids[:-1],
        index_path=None,
        storage_dtype=torch.float8_e4m3fn,
    )
    assert f8["dtype"] == "float8_e4m3fn" and f8["bytes"] < 0.55 * bf["bytes"]
    r = ShardReader(tmp_path / "fp8.safetensors")
    for i, want in enumerate(states):
        got = r.sample(i)["hidden_states"]
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        x, y = want.float(), got.float()
        amax = x.abs().amax(-1, keepdim=True)
        assert torch.equal(y.abs().amax(-1, keepdim=True), amax)  # each row's largest element is exact
        err = (x - y).abs()
        # half an e4m3 step: 2^-4 of |x| (normal range), plus bf16 rounding of the result
        assert bool((err <= x.abs() * 2**-4 + amax / 448 * 2**-9 + x.abs() * 2**-8).all())
        assert float(err.max()) > 0  # it is lossy: the test would notice a no-op
    # filled in place in two parts (two chunks of a job) == written in one go, byte for byte
    from eagle3_pipeline.shards import ShardWriter, shard_index

    rows = np.cumsum([0] + [len(s.input_ids) for s in samples]).tolist()
    with ShardWriter.create(
        tmp_path / "parts.safetensors",
        samples,
        layer_ids=layer_ids,
        aux_layer_ids=layer_ids[:-1],
        hidden_size=states[0].shape[-1],
        storage_dtype=torch.float8_e4m3fn,
    ) as w:
        for i in (3, 2):  # second chunk first
            w.write_states(rows[i], states[i])
        w.write_states(rows[0], torch.cat(states[:2]))
    parts = shard_index(tmp_path / "parts.safetensors", samples, layer_ids=layer_ids, aux_layer_ids=layer_ids[:-1], index_path=None)
    assert parts["sha256"] == f8["sha256"]


def test_fp8_dequantization_on_cpu_equals_torchs_cast_for_every_bit_pattern():
    """The table-based CPU dequantisation gives exactly (q.float() * scale).to(dtype), NaN codes included."""
    from eagle3_pipeline.shards import dequantize_fp8

    q = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(4, 2, 32)  # every code once
    scale = torch.tensor([[1.0, 0.5], [3.7e-3, 2.0], [448.0, 1e-30], [0.125, 7.0]])
    for dtype in (torch.bfloat16, torch.float32):
        got = dequantize_fp8(q, scale, dtype)
        want = (q.float() * scale[..., None]).to(dtype)
        assert got.dtype == dtype and got.shape == (4, 2, 32)
        nan = torch.isnan(want)
        assert int(nan.sum()) == 2 * 1 and torch.equal(torch.isnan(got), nan)  # 0x7f and 0xff
        assert torch.equal(got[~nan], want[~nan])
    strided = q.transpose(0, 1)  # a non-contiguous view reads the same values
    assert torch.equal(dequantize_fp8(strided, scale.T, torch.float32).nan_to_num(), (strided.float() * scale.T[..., None]).nan_to_num())


def test_a_compressed_tensors_target_is_extracted_from_its_dequantized_weights(tmp_path):
    """A W4A16 checkpoint (compressed-tensors, Kimi-K2.5's format) goes through the hf backend: its
    states equal a float32 forward of the dequantized weights within bf16 rounding. transformers'
    default kept it compressed until a call of the whole model, which extraction never makes, and
    every quantized layer failed with "'Linear' object has no attribute 'weight'"."""
    import transformers
    from quant_support import dequantized_fp32, quantize

    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    target = quantize(tmp_path / "bf16", tmp_path / "w4a16", dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
    assert json.loads((target / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"
    gen = torch.Generator().manual_seed(1)
    samples = [Sample(f"s{i}", torch.randint(0, 256, (n,), generator=gen).numpy(), loss_mask(4, n - 4)) for i, n in enumerate([9, 23, 16])]
    layer_ids = [1, 2, 4]
    got = torch.cat(extract_hf(load_hf_target(str(target), "cpu"), samples, layer_ids, batch_tokens=4096, storage_dtype=torch.float32))
    ref = torch.cat(extract_hf(dequantized_fp32(target), samples, layer_ids, batch_tokens=4096, storage_dtype=torch.float32))
    unquantized = torch.cat(
        extract_hf(
            load_hf_target(str(tmp_path / "bf16"), "cpu").float(), samples, layer_ids, batch_tokens=4096, storage_dtype=torch.float32
        )
    )
    for k in range(len(layer_ids)):
        rms = ref[:, k].pow(2).mean().sqrt()
        assert (got[:, k] - ref[:, k]).pow(2).mean().sqrt() / rms < 0.01  # bf16 compute of the same weights
        assert (unquantized[:, k] - ref[:, k]).pow(2).mean().sqrt() / rms > 0.03  # 4-bit weights do change the states


def test_a_w4a16_mixture_of_experts_is_extracted_from_its_dequantized_experts(tmp_path):
    """Kimi-K2.5's form, small: a Qwen3-MoE whose attention and every expert's projections are
    compressed-tensors W4A16 (group 32, one packed tensor per expert). transformers 5 holds the
    experts fused in 3-D parameters; the hf backend must still load each expert's dequantized
    weights into them. The reference quantizes the bf16 source independently
    (quant_support.fake_quantized_int4) and runs in float32."""
    import re

    import transformers
    from quant_support import MOE_W4A16_WEIGHTS, fake_quantized_int4, quantize_moe_w4a16

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    target = quantize_moe_w4a16(tmp_path / "bf16", tmp_path / "w4a16")
    from safetensors import safe_open

    with safe_open(target / "model.safetensors", "pt") as f:
        packed = [k for k in f.keys() if k.endswith(".weight_packed")]  # noqa: SIM118 (safe_open has no __iter__)
    assert len(packed) == 4 * (4 + 4 * 3)  # per layer: q, k, v, o and 4 experts x (gate, up, down)
    # the reference: the bf16 source in float32, every quantized projection through the W4A16 arithmetic
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    fused = re.compile(r".*(self_attn\.[qkvo]_proj\.weight|mlp\.experts\.(gate_up_proj|down_proj))$")
    with torch.no_grad():
        for name, p in ref_model.named_parameters():
            if fused.match(name):
                p.copy_(fake_quantized_int4(p.data).to(p.dtype))
    ref_model = ref_model.float().eval()
    assert re.match(MOE_W4A16_WEIGHTS, "model.layers.0.mlp.experts.3.down_proj.weight")
    gen = torch.Generator().manual_seed(1)
    samples = [Sample(f"s{i}", torch.randint(0, 256, (n,), generator=gen).numpy(), loss_mask(4, n - 4)) for i, n in enumerate([9, 23, 16])]
    layer_ids = [1, 2, 4]

    def states(model):
        return torch.cat(extract_hf(model, samples, layer_ids, batch_tokens=4096, storage_dtype=torch.float32))

    got, ref = states(load_hf_target(str(target), "cpu")), states(ref_model)
    unquantized = states(load_hf_target(str(tmp_path / "bf16"), "cpu").float())
    for k in range(len(layer_ids)):
        rms = ref[:, k].pow(2).mean().sqrt()
        assert (got[:, k] - ref[:, k]).pow(2).mean().sqrt() / rms < 0.01  # bf16 compute of the same weights
        assert (unquantized[:, k] - ref[:, k]).pow(2).mean().sqrt() / rms > 0.03  # 4-bit experts do change the states


def test_a_shard_is_preallocated_where_the_filesystem_can_and_sized_sparse_where_not(tmp_path, monkeypatch):
    from eagle3_pipeline import shards
    from eagle3_pipeline.shards import ShardWriter, preallocate

    samples = [Sample(f"s{i}", np.arange(600, dtype=np.int64), loss_mask(100, 500)) for i in range(3)]
    kw = dict(layer_ids=[1, 3], aux_layer_ids=[1], hidden_size=64, storage_dtype=torch.bfloat16)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    calls = []
    monkeypatch.setattr(shards, "preallocate", lambda fd, size: calls.append((size, preallocate(fd, size))) or calls[-1][1])
    ShardWriter.create(a, samples, **kw).close()
    monkeypatch.setattr(shards, "preallocate", lambda fd, size: False)
    ShardWriter.create(b, samples, **kw).close()
    states = 1800 * 2 * 64 * 2  # tokens x layers x hidden x bf16 bytes
    assert calls[0][0] == a.stat().st_size == b.stat().st_size > states
    assert a.read_bytes() == b.read_bytes()  # the same header, ids, masks and zero states either way
    assert b.stat().st_blocks * 512 < states  # sparse: the zero states hold no blocks
    if calls[0][1]:
        assert a.stat().st_blocks * 512 >= a.stat().st_size
    # preallocate itself: the blocks are there, or it says it did nothing
    fd = os.open(tmp_path / "c.bin", os.O_RDWR | os.O_CREAT)
    try:
        if not preallocate(fd, 1 << 20):
            pytest.skip("this filesystem has no fallocate")
        assert os.fstat(fd).st_size == 1 << 20 and os.fstat(fd).st_blocks * 512 >= 1 << 20
    finally:
        os.close(fd)
    ro = os.open(tmp_path / "c.bin", os.O_RDONLY)  # fallocate fails (EBADF): nothing changed, False
    try:
        assert preallocate(ro, 2 << 20) is False and os.fstat(ro).st_size == 1 << 20
    finally:
        os.close(ro)


def test_the_disk_preflight_counts_the_space_a_killed_jobs_partial_shard_holds(tmp_path, target_dir, monkeypatch):
    """A preallocated partial shard kept from a killed job holds its space already: a resumed job
    needs only the rest free (the shard is reused, or replaced where it no longer matches)."""
    import re
    import shutil
    from collections import namedtuple

    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.hidden_states import run_extraction_shard
    from eagle3_pipeline.hygiene import hidden_state_bytes
    from eagle3_pipeline.io import InputError
    from eagle3_pipeline.resume import ChunkStore
    from eagle3_pipeline.shards import partial_shard_path, preallocate

    traces = tmp_path / "traces.jsonl"
    rows = [{"id": f"t{i}", "prompt_token_ids": list(range(1, 40)), "completion_token_ids": list(range(40, 100))} for i in range(500)]
    traces.write_text("".join(json.dumps(r) + "\n" for r in rows))
    need = hidden_state_bytes(500 * 99, 4, 576, 2)  # SmolLM2: hidden 576, 3 aux layers + the last, bf16
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**12, 0, 1000))
    cfg = validate_config({"extraction": {}})["extraction"] | {"data_parallel_size": 1, "gpus_per_replica": 1}
    out = tmp_path / "shard-00000.safetensors"

    def needed() -> int:
        with pytest.raises(InputError, match="extraction of .* needs about") as e:
            run_extraction_shard(
                str(traces), str(out), str(tmp_path / "i.json"), str(target_dir), cfg,
                max_seq_len=2048, trust_remote_code=False, host_lock_enabled=False,
            )  # fmt: skip
        return round(float(re.search(r"needs about ([0-9.]+) GB", str(e.value)).group(1)) * 1e9)

    assert abs(needed() - need) <= 5e6  # the message rounds to 10 MB
    kept = partial_shard_path(ChunkStore.dir_for(out))
    kept.parent.mkdir(parents=True)
    fd = os.open(kept, os.O_RDWR | os.O_CREAT)
    try:
        if not preallocate(fd, need // 2):
            pytest.skip("this filesystem has no fallocate")
    finally:
        os.close(fd)
    held = os.stat(kept).st_blocks * 512
    assert held >= need // 2 and abs(needed() - (need - held)) <= 5e6


def test_a_shard_that_does_not_fit_is_named_and_its_partial_allocation_given_back(tmp_path, monkeypatch):
    """fallocate(2) failing with no space (ext4 and XFS keep what they allocated) refuses the
    shard with its path; failing as unsupported sizes it sparse."""
    import ctypes
    import errno

    from eagle3_pipeline import shards
    from eagle3_pipeline.io import InputError
    from eagle3_pipeline.shards import ShardReader, ShardWriter

    samples = [Sample(f"s{i}", np.arange(600, dtype=np.int64), loss_mask(100, 500)) for i in range(3)]
    kw = dict(layer_ids=[1, 3], aux_layer_ids=[1], hidden_size=64, storage_dtype=torch.bfloat16)
    seen = {}

    def failing(code):
        def fallocate(fd, mode, offset, size):
            os.truncate(f"/proc/self/fd/{fd}", size // 2)  # what a partial allocation leaves: a longer file
            seen["size"] = size
            ctypes.set_errno(code)
            return -1

        return lambda: fallocate

    monkeypatch.setattr(shards, "_fallocate", failing(errno.ENOSPC))
    path = tmp_path / "full.safetensors"
    with pytest.raises(
        InputError, match=rf"^{path}: no room for this hidden-state shard of 0\.00 GB \(No space left on device\); free space"
    ):
        ShardWriter.create(path, samples, **kw)
    assert path.stat().st_size == 0  # given back
    monkeypatch.setattr(shards, "_fallocate", failing(errno.EOPNOTSUPP))
    path = tmp_path / "sparse.safetensors"
    ShardWriter.create(path, samples, **kw).close()
    assert path.stat().st_size == seen["size"] and len(ShardReader(path)) == 3


def test_the_batch_writer_writes_rows_in_place_marks_chunks_after_their_batches_and_raises_a_nan_sample(tmp_path):
    """Batches written by the writer thread land at their samples' rows; a chunk's marker follows
    its batches; a NaN sample's error reaches the caller unchanged, naming the sample, with the
    chunk before it kept and nothing of its own batch written."""
    from eagle3_pipeline.hf_backend import BatchWriter, HostBatch
    from eagle3_pipeline.resume import ChunkStore
    from eagle3_pipeline.shards import DONE_SUFFIX, ShardWriter

    lengths = [5, 3, 4, 2]
    samples = [Sample(f"s{i}", np.arange(n, dtype=np.int64), loss_mask(1, n - 1)) for i, n in enumerate(lengths)]
    rows = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    path, store = tmp_path / "x.safetensors", ChunkStore.attach(tmp_path / "final.safetensors", DONE_SUFFIX)
    store.dir.mkdir()
    g = torch.Generator().manual_seed(0)
    want = [torch.randn(n, 2, 8, generator=g).to(torch.bfloat16) for n in lengths]

    def host_batch(idx: list[int], first: int, bad_row: int | None = None) -> HostBatch:
        t_max = max(lengths[first + i] for i in idx)
        buf = torch.full((len(idx), t_max, 2, 8), 7.0, dtype=torch.bfloat16)  # 7.0: padding, never written
        for r, i in enumerate(idx):
            buf[r, : lengths[first + i]] = want[first + i]
        bad = torch.zeros(len(idx), dtype=torch.bool)
        if bad_row is not None:
            bad[bad_row] = True
        return HostBatch(idx, [lengths[first + i] for i in idx], buf, bad, [samples[first + i].id for i in idx])

    kw = dict(layer_ids=[1, 3], aux_layer_ids=[1], hidden_size=8, storage_dtype=torch.bfloat16)
    with ShardWriter.create(path, samples, **kw) as shard:
        w = BatchWriter(shard, store, rows, num_chunks=2, depth=1)
        w.batch(host_batch([0], 0), 0)  # chunk 0: samples 0-1, in two batches, longest first
        w.batch(host_batch([1], 0), 0)
        w.chunk_done(0, 0, 2)
        w.batch(host_batch([1, 0], 2, bad_row=1), 2)  # chunk 1: samples 3 and 2, sample s2 NaN
        with pytest.raises(FloatingPointError, match="sample s2"):
            w.chunk_done(1, 2, 4)
            w.close()
        w.close(abort=True)
    assert store.finished() == [0]
    assert w.stats["batches"] == 2 and w.stats["bytes"] == 8 * 2 * 8 * 2
    got = ShardReader(path).all_hidden_states()
    assert torch.equal(got[:8], torch.cat(want[:2]))
    assert not got[8:].any()  # chunk 1's batch was refused whole: its rows are still the preallocated zeros


def test_a_failed_write_in_the_batch_writer_names_the_shard_and_what_to_do(tmp_path):
    """A full disk (ENOSPC from a write) reaches the caller as the same OSError, with a note naming
    the shard and its chunk folder and saying that the done chunks are kept for a rerun."""
    import errno

    from eagle3_pipeline.hf_backend import BatchWriter, HostBatch
    from eagle3_pipeline.resume import ChunkStore
    from eagle3_pipeline.shards import DONE_SUFFIX, ShardWriter

    samples = [Sample("s0", np.arange(3, dtype=np.int64), loss_mask(1, 2))]
    path, store = tmp_path / "x.safetensors", ChunkStore.attach(tmp_path / "final.safetensors", DONE_SUFFIX)
    store.dir.mkdir()
    kw = dict(layer_ids=[1, 3], aux_layer_ids=[1], hidden_size=8, storage_dtype=torch.bfloat16)
    with ShardWriter.create(path, samples, **kw) as shard:

        def full(*_):
            raise OSError(errno.ENOSPC, "No space left on device")

        shard.write_states = full
        w = BatchWriter(shard, store, [0], num_chunks=1)
        w.batch(HostBatch([0], [3], torch.zeros(1, 3, 2, 8, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bool), ["s0"]), 0)
        with pytest.raises(OSError) as e:
            w.chunk_done(0, 0, 1)
            w.close()
        w.close(abort=True)
    assert e.value.errno == errno.ENOSPC
    (note,) = e.value.__notes__
    assert str(path) in note and str(store.dir) in note and "rerun to resume" in note
    assert store.finished() == []
