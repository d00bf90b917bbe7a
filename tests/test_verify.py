"""The verify target names missing, truncated and altered shards."""

import json

import numpy as np
import torch

from eagle3_pipeline.conventions import loss_mask
from eagle3_pipeline.hidden_states import Sample, write_shard
from eagle3_pipeline.io import sha256_file
from eagle3_pipeline.verify import verify_run


def make_run(tmp_path):
    traces = tmp_path / "shard-00000.jsonl"
    traces.write_text('{"id": "a"}\n{"id": "b"}\n')
    (tmp_path / "shard-00000.summary.json").write_text(json.dumps({"ok": 2, "traces_sha256": sha256_file(traces)}))
    samples = [Sample("a", np.arange(6), loss_mask(3, 3)), Sample("b", np.arange(4), loss_mask(2, 2))]
    states = [torch.randn(6, 2, 8, dtype=torch.bfloat16), torch.randn(4, 2, 8, dtype=torch.bfloat16)]
    hs = tmp_path / "shard-00000.safetensors"
    write_shard(hs, samples, states, layer_ids=[2, 30], aux_layer_ids=[2], index_path=tmp_path / "shard-00000.index.json")
    return traces, hs


def test_intact_run_verifies(tmp_path):
    traces, hs = make_run(tmp_path)
    assert verify_run([str(traces)], [str(hs)]) == {"checked": 2, "manifest": None, "problems": []}


def test_truncated_hidden_state_shard_is_named(tmp_path):
    traces, hs = make_run(tmp_path)
    data = hs.read_bytes()
    hs.write_bytes(data[: len(data) - 100])
    problems = verify_run([str(traces)], [str(hs)])["problems"]
    assert any(str(hs) in p and "truncated" in p for p in problems)
    assert any("unreadable" in p for p in problems)


def test_altered_and_missing_trace_shards_are_named(tmp_path):
    traces, hs = make_run(tmp_path)
    traces.write_text('{"id": "a"}\n')
    problems = verify_run([str(traces), str(tmp_path / "shard-00001.jsonl")], [str(hs)])["problems"]
    assert any("sha256" in p and str(traces) in p for p in problems)
    assert any("1 records, the manifest says 2" in p for p in problems)
    assert f"{tmp_path / 'shard-00001.jsonl'}: missing" in problems
