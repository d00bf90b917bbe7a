"""Data-parallel replicas inside one full-model job, and multi-process (DDP/FSDP) training."""

import functools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from train_support import write_random_train_inputs

from eagle3_pipeline.config import validate_config
from eagle3_pipeline.hidden_states import run_extraction_shard
from eagle3_pipeline.parallel import replica_devices, replica_gpus, run_replicas, visible_gpus
from eagle3_pipeline.shards import read_shard
from eagle3_pipeline.training import run_training


def test_replicas_get_consecutive_gpu_slices():
    assert replica_devices(2, 1, ["0", "1"]) == ["0", "1"]
    assert replica_devices(2, 2, ["0", "1", "2", "3"]) == ["0,1", "2,3"]
    assert replica_devices(2, 2, ["4", "5", "6", "7", "0"]) == ["4,5", "6,7"]
    assert replica_devices(3, 1, []) == [None, None, None]  # CPU: no restriction
    with pytest.raises(ValueError, match=r"needs 4 GPUs, but this job sees 2 \(0,1\)"):
        replica_devices(2, 2, ["0", "1"])


def test_replicas_per_gpu_share_each_gpu_in_turn():
    assert [replica_gpus(d, 1, 2) for d in (1, 2, 3, 4)] == [1, 1, 2, 2] and replica_gpus(2, 4) == 8
    assert replica_devices(4, 1, ["0", "1"], 2) == ["0", "0", "1", "1"]
    assert replica_devices(3, 1, ["2", "5"], 2) == ["2", "2", "5"]
    assert replica_devices(3, 1, ["0"], 3) == ["0", "0", "0"]
    assert replica_devices(2, 1, [], 2) == [None, None]
    with pytest.raises(ValueError, match=r"data_parallel_size 5 \(2 per GPU\) x 1 GPU\(s\) per replica needs 3 GPUs, but this job sees 2"):
        replica_devices(5, 1, ["0", "1"], 2)
    with pytest.raises(ValueError, match=r"a replica uses 2 GPUs \(tensor x pipeline parallel\); set vllm.replicas_per_gpu to 1"):
        replica_devices(2, 2, ["0", "1", "2", "3"], 2)


def _record_engine_start(out_dir: str, engines: int, rank: int, items) -> None:
    """A worker that 'starts an engine' inside engine_turn and records when, with what share, and
    whether, while in its turn, it saw an engine of another GPU in its turn too (waiting up to 20 s).

    It takes its further items only once ``engines`` replicas have had their turn (up to 60 s): a
    replica takes its first item before its engine starts, and one slow to spawn would otherwise
    find every item taken by the others and start none (``parallel.replica_items``)."""
    import time

    from eagle3_pipeline.parallel import engine_turn, memory_share

    gpu = os.environ.get("CUDA_VISIBLE_DEVICES")
    with engine_turn():
        t0 = time.monotonic()
        Path(out_dir, f"turn-{gpu}-{rank}").touch()
        deadline = time.monotonic() + 20
        while not (met := any(p.name.split("-")[1] != gpu for p in Path(out_dir).glob("turn-*"))) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        t1 = time.monotonic()
    deadline = time.monotonic() + 60
    while len(list(Path(out_dir).glob("turn-*"))) < engines and time.monotonic() < deadline:
        time.sleep(0.05)
    rec = {"start": t0, "end": t1, "share": memory_share(0.9), "gpu": gpu, "met_other_gpu": met, "items": list(items)}
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(rec))


def _engine_starts(tmp_path, monkeypatch, visible: str, items: int, replicas: int, per_gpu: int) -> list[dict]:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)  # the replicas do not touch CUDA
    engines = min(items, replicas)  # every replica that can get an item starts an engine
    run_replicas(functools.partial(_record_engine_start, str(tmp_path), engines), list(range(items)), replicas, 1, per_gpu)
    recs = sorted((json.loads(p.read_text()) for p in tmp_path.glob("rank-*.json")), key=lambda r: r["start"])
    assert sorted(i for r in recs for i in r["items"]) == list(range(items))
    return recs


def _overlap(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


@pytest.mark.processes
def test_engines_sharing_a_gpu_start_one_at_a_time(tmp_path, monkeypatch):
    """Four replicas, two per GPU: engines of one GPU never start together, those of different GPUs do."""
    recs = _engine_starts(tmp_path, monkeypatch, "0,1", 8, 4, 2)
    assert sorted(r["gpu"] for r in recs) == ["0", "0", "1", "1"] and {r["share"] for r in recs} == {0.45}
    for gpu in ("0", "1"):
        a, b = (r for r in recs if r["gpu"] == gpu)
        assert not _overlap(a, b), gpu  # the second engine of a GPU started after the first was up
    assert all(r["met_other_gpu"] for r in recs)  # one lock per GPU: the other GPU's engine started meanwhile


@pytest.mark.processes
def test_replicas_with_gpus_of_their_own_start_side_by_side(tmp_path, monkeypatch):
    recs = _engine_starts(tmp_path, monkeypatch, "0,1", 6, 2, 1)
    assert sorted(r["gpu"] for r in recs) == ["0", "1"] and [r["share"] for r in recs] == [0.9, 0.9]
    assert all(r["met_other_gpu"] for r in recs)  # no start lock: both engines started together


@pytest.mark.processes
def test_fewer_chunks_than_replicas_use_every_gpu_before_sharing_one(tmp_path, monkeypatch):
    """Two chunks left of a job of 4 replicas on 2 GPUs (2 per GPU): one replica per GPU, each with the GPU's share."""
    recs = _engine_starts(tmp_path, monkeypatch, "0,1", 2, 4, 2)
    assert sorted(r["gpu"] for r in recs) == ["0", "1"] and [r["share"] for r in recs] == [0.9, 0.9]
    # three chunks: the third replica shares a GPU
    for p in [*tmp_path.glob("rank-*.json"), *tmp_path.glob("turn-*")]:
        p.unlink()
    recs = _engine_starts(tmp_path, monkeypatch, "0,1", 3, 4, 2)
    # three replicas are placed (two share GPU 0), each with a chunk; the fourth finds none and starts no engine
    assert sorted(r["gpu"] for r in recs) == ["0", "0", "1"]
    assert all(r["share"] == (0.45 if r["gpu"] == "0" else 0.9) for r in recs)


def test_an_engine_sharing_its_gpu_gets_its_part_of_the_memory_whoever_set_it(monkeypatch):
    import vllm

    from eagle3_pipeline import engine, parallel

    got = []
    monkeypatch.setattr(vllm, "LLM", lambda **kw: got.append(kw))
    monkeypatch.setattr(engine, "on_cpu", lambda: False)
    v = validate_config({"vllm": {"gpu_memory_utilization": 0.9}})["vllm"]
    engine.build_llm("m", v, seed=0, max_model_len=64)
    monkeypatch.setattr(parallel, "_SHARING", 2)  # as run_replicas sets it in a replica with a GPU of two
    engine.build_llm("m", v, seed=0, max_model_len=64)
    engine.build_llm("m", v | {"extra_engine_args": {"gpu_memory_utilization": 0.8}}, seed=0, max_model_len=64)
    assert [kw["gpu_memory_utilization"] for kw in got] == [0.9, 0.45, 0.4]


def test_visible_gpus_honours_cuda_visible_devices(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert visible_gpus() == ["3", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-a)'\necho 'GPU 1: NVIDIA H200 (UUID: GPU-b)'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert visible_gpus() == ["0", "1"]


def _record_items(out_dir: str, fail_on: int | None, rank: int, items) -> None:
    for item in items:
        if item == fail_on:
            raise SystemExit(3)
        Path(out_dir, f"item-{item}").write_text(f"{rank} {os.getpid()}")


@pytest.mark.processes
def test_replicas_share_items_exactly_once(tmp_path):
    run_replicas(functools.partial(_record_items, str(tmp_path), None), list(range(10)), 2, 1)
    done = {int(p.name[5:]): p.read_text().split() for p in tmp_path.glob("item-*")}
    assert sorted(done) == list(range(10))
    assert {pid for _, pid in done.values()} <= {pid for _, pid in done.values()} and str(os.getpid()) not in {
        pid for _, pid in done.values()
    }  # done in replica processes, not here


@pytest.mark.processes
def test_a_failed_replica_is_an_error_naming_it(tmp_path):
    with pytest.raises(RuntimeError, match=r"data-parallel replica \d failed \(exit code 3\)"):
        run_replicas(functools.partial(_record_items, str(tmp_path), 0), [0, 1], 2, 1)


@pytest.mark.processes
def test_one_replica_runs_in_process(tmp_path):
    run_replicas(functools.partial(_record_items, str(tmp_path), None), [0, 1], 1, 1)
    assert {p.read_text().split()[1] for p in tmp_path.glob("item-*")} == {str(os.getpid())}


def _traces(path: Path, n: int) -> None:
    rng = np.random.default_rng(1)
    with open(path, "w") as f:
        for i in range(n):
            p, c = rng.integers(1, 49152, size=int(rng.integers(8, 30))), rng.integers(1, 49152, size=int(rng.integers(8, 40)))
            f.write(json.dumps({"id": f"{i:016x}", "prompt_token_ids": p.tolist(), "completion_token_ids": c.tolist()}) + "\n")


def test_data_parallel_extraction_equals_one_replica(tmp_path, target_dir):
    """Two CPU replicas sharing the chunks write the same shard, bit for bit, as one."""
    _traces(tmp_path / "traces.jsonl", 10)
    cfg = validate_config({"extraction": {"chunk_samples": 3, "device": "cpu"}})["extraction"]
    out = {}
    for dp in (1, 2):
        shard, index = tmp_path / f"dp{dp}.safetensors", tmp_path / f"dp{dp}.index.json"
        out[dp] = run_extraction_shard(
            str(tmp_path / "traces.jsonl"),
            str(shard),
            str(index),
            str(target_dir),
            {**cfg, "data_parallel_size": dp, "gpus_per_replica": 1},
            max_seq_len=256,
            trust_remote_code=False,
        )
    assert out[2]["data_parallel_size"] == 2 and len(out[2]["replicas"]) == 2
    assert sum(r["chunks"] for r in out[2]["replicas"]) == 4  # 10 samples / 3 per chunk
    assert out[1]["sha256"] == out[2]["sha256"]
    s1, h1, *_ = read_shard(tmp_path / "dp1.safetensors")
    s2, h2, *_ = read_shard(tmp_path / "dp2.safetensors")
    assert [s.id for s in s1] == [s.id for s in s2] == [f"{i:016x}" for i in range(10)]
    assert all(torch.equal(a, b) for a, b in zip(h1, h2, strict=True))


@pytest.fixture(scope="module")
def train_inputs(tmp_path_factory, target_dir):
    d = tmp_path_factory.mktemp("ddp")
    write_random_train_inputs(d, 16)
    return d


def _run(
    d: Path,
    name: str,
    target: Path,
    processes: int,
    accum: int,
    parallelism: str = "ddp",
    checkpoint_every_steps: int = 50,
    epochs: int = 1,
) -> tuple[dict, dict]:
    cfg = validate_config(
        {
            "training": {
                "epochs": epochs,
                "pack_tokens": 128,
                "val_fraction": 0.0,
                "log_every_steps": 1,
                "optimizer": "adamw",
                "autocast": "none",
                "hidden_states_dtype": "float32",
                "device": "cpu",
                "gradient_accumulation_steps": accum,
                "parallelism": parallelism,
                "checkpoint_every_steps": checkpoint_every_steps,
            }
        }
    )["training"]
    summary = run_training(
        {
            "shards": [str(d / "shard-00000.safetensors")],
            "vocab_dir": str(d / "vocab"),
            "target_path": str(target),
            "out_dir": str(d / name / "drafter"),
            "metrics_path": str(d / name / "metrics.jsonl"),
            "cfg": cfg,
            "seed": 0,
            "max_seq_len": 128,
        },
        processes,
    )
    return summary, load_file(str(d / name / "drafter" / "model.safetensors"))


def test_two_process_ddp_equals_one_process_with_accumulation(train_inputs, target_dir):
    """2 ranks x 1 pack per step see exactly the packs of 1 rank x 2 accumulated packs.

    Tolerance: fp32 (no autocast, fp32 hidden states, AdamW); gradients are averaged by an
    all-reduce instead of accumulated in one process, which reorders float additions:
    differences stay at float32 rounding (~1e-6 relative), far below one AdamW step (lr 1e-3).
    Saved weights are bf16, so they must agree to within one bf16 ulp.
    """
    s1, w1 = _run(train_inputs, "one", target_dir, 1, 2)
    s2, w2 = _run(train_inputs, "ddp", target_dir, 2, 1)
    assert s2["world_size"] == 2 and s2["parallelism"] == "ddp" and s1["world_size"] == 1
    assert s1["steps"] == s2["steps"] >= 3
    assert s1["tokens_seen"] == s2["tokens_seen"]
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w1[k].float(), w2[k].float(), rtol=8e-3, atol=1e-5, msg=k)
    # The comparison can fail: 1 rank without accumulation (other packs per step) ends elsewhere.
    _, w3 = _run(train_inputs, "one-noaccum", target_dir, 1, 1)
    far = [k for k in w1 if not torch.allclose(w1[k].float(), w3[k].float(), rtol=8e-3, atol=1e-5)]
    assert "layers.0.self_attn.q_proj.weight" in far
    m1 = [json.loads(x) for x in (train_inputs / "one" / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x) for x in (train_inputs / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in m1] == [x["step"] for x in m2]
    for x, y in zip(m1, m2, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4)


def test_too_few_packs_for_the_processes_is_a_clear_error(train_inputs, target_dir):
    with pytest.raises(Exception, match="fewer than train_gpus x gradient_accumulation_steps"):
        _run(train_inputs, "many", target_dir, 1, 10_000)


@pytest.mark.e2e
def test_data_parallel_generation_equals_one_engine(tmp_path, target_dir, one_engine_traces):
    """Two vLLM engine replicas (CPU, started in turn) sharing the chunks write the traces one engine writes (greedy)."""
    from eagle3_pipeline.generation import run_generation_shard
    from eagle3_pipeline.io import read_jsonl

    ref = one_engine_traces
    out = {k: str(tmp_path / f"dp2.{k}.jsonl") for k in ("traces", "rejects", "summary")}
    # the two replicas also share "a GPU" (replicas_per_gpu): their engines start one at a time
    params = ref.params | {"vllm": ref.params["vllm"] | {"data_parallel_size": 2, "replicas_per_gpu": 2}}
    summary = run_generation_shard(str(ref.prompts), out, str(target_dir), params, chunk_prompts=ref.chunk_prompts)
    assert summary["data_parallel_size"] == summary["replicas_per_gpu"] == 2 and len(summary["replicas"]) == 2
    # the replicas share the chunks through a queue: together they did all three, whoever took which
    assert sum(r["chunks"] for r in summary["replicas"]) == 3
    got = list(read_jsonl(out["traces"]))
    assert [t["id"] for t in got] == [t["id"] for t in ref.traces]
    for a, b in zip(ref.traces, got, strict=True):
        assert a["completion_token_ids"] == b["completion_token_ids"] and len(a["completion_token_ids"]) > 0


def test_killed_ddp_training_resumes_to_the_same_weights(train_inputs, target_dir, monkeypatch):
    """Both ranks die after the checkpoint of step 2 (torchrun reports it); the rerun continues there."""
    ref = train_inputs / "ddp" / "drafter" / "model.safetensors"
    if not ref.is_file():
        _run(train_inputs, "ddp", target_dir, 2, 1)
    _, want = _run_ckpt(train_inputs, target_dir, monkeypatch)
    got = load_file(str(ref))
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k


def _run_ckpt(d: Path, target: Path, monkeypatch):
    import shutil

    shutil.rmtree(d / "killed", ignore_errors=True)
    monkeypatch.setenv("EAGLE3_FAULT_KILL_AFTER_STEPS", "2")
    with pytest.raises(RuntimeError, match="distributed training failed"):
        _run(d, "killed", target, 2, 1, checkpoint_every_steps=1)
    assert (d / "killed" / ".checkpoint" / "state.pt").is_file() and not (d / "killed" / "drafter").exists()
    monkeypatch.delenv("EAGLE3_FAULT_KILL_AFTER_STEPS")
    summary, weights = _run(d, "killed", target, 2, 1, checkpoint_every_steps=1)
    assert summary["resumed_from_step"] == 2
    return summary, weights


def test_epochs_with_fewer_packs_than_the_first_train_to_the_end(train_inputs, target_dir):
    """Packing follows each epoch's shuffle, so epochs differ in pack count (here 9-11 packs of 128
    tokens): each epoch runs the steps its own packs fill (a fixed count overran a short epoch)."""
    summary, _ = _run(train_inputs, "epochs", target_dir, 1, 1, epochs=4)
    lines = [json.loads(x) for x in (train_inputs / "epochs" / "metrics.jsonl").read_text().splitlines()]
    per_epoch = [sum(1 for x in lines if x["epoch"] == e) for e in range(4)]
    assert summary["steps"] == len(lines) == sum(per_epoch)
    assert len(set(per_epoch)) > 1 and min(per_epoch) >= 9, per_epoch  # here [11, 10, 10, 9]


@pytest.mark.processes
def test_more_training_processes_than_gpus_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = validate_config({"training": {"device": "cuda"}})["training"]
    with pytest.raises(RuntimeError, match=r"resources.train_gpus=2 but this job sees 1 GPU\(s\)"):
        run_training({"cfg": cfg}, 2)


def test_a_replica_that_finds_no_chunk_left_starts_no_engine():
    """Each replica takes its first chunk before its worker (and engine) starts; one whose first
    take is the end marker gets nothing to run."""
    import queue as q

    from eagle3_pipeline.parallel import replica_items

    shared = q.Queue()
    for x in (4, 7, None, None):  # two chunks, two replicas
        shared.put(x)
    assert list(replica_items(shared)) == [4, 7]  # the first replica took both chunks and its end marker
    assert replica_items(shared) is None  # the second finds only its end marker: no worker, no engine


def test_an_engine_stops_in_its_gpus_turn(monkeypatch):
    """shutdown_llm waits while another engine on the same GPU holds the turn (starting, i.e. profiling
    the GPU's memory), and stops its engine only once that start is over."""
    import threading
    import time

    from eagle3_pipeline import parallel
    from eagle3_pipeline.engine import shutdown_llm

    lock = threading.Lock()
    monkeypatch.setattr(parallel, "_START_LOCK", lock)
    events = []

    class Core:
        def shutdown(self):
            events.append(("stopped", time.monotonic()))

    llm = type("LLM", (), {"llm_engine": type("E", (), {"engine_core": Core()})()})()
    lock.acquire()  # another replica's engine is starting
    stopper = threading.Thread(target=shutdown_llm, args=(llm,))
    stopper.start()
    time.sleep(0.3)
    assert events == []  # still waiting for the turn
    events.append(("start over", time.monotonic()))
    lock.release()
    stopper.join(5)
    assert [e[0] for e in events] == ["start over", "stopped"]


def test_extra_engine_args_may_not_set_what_the_workflow_sets(monkeypatch):
    """vllm.extra_engine_args {max_model_len: 99} ran engines shorter than the max_seq_len the stages
    plan for; every LLM argument build_llm and extraction set is refused there, naming its setting."""
    import vllm

    from eagle3_pipeline import engine
    from eagle3_pipeline.config import ENGINE_ARGS_FROM_SETTINGS, ConfigError
    from eagle3_pipeline.vllm_extraction import engine_overrides

    got = []
    monkeypatch.setattr(vllm, "LLM", lambda **kw: got.append(kw))
    monkeypatch.setattr(engine, "on_cpu", lambda: False)
    v = validate_config({"vllm": {"max_num_seqs": 8, "extra_engine_args": {"block_size": 32}}})["vllm"]
    engine.build_llm("m", v, seed=0, max_model_len=64, **engine_overrides([2, 4]))
    assert got[0]["block_size"] == 32  # an argument the workflow leaves alone passes through
    assert set(got[0]) - {"block_size", "disable_log_stats"} <= set(ENGINE_ARGS_FROM_SETTINGS)
    with pytest.raises(ConfigError, match=r"vllm.extra_engine_args.max_model_len is set by the workflow from max_seq_len; .*seed"):
        validate_config({"vllm": {"extra_engine_args": {"max_model_len": 99, "seed": 1, "block_size": 32}}})
