"""Killed shard jobs resume at chunk granularity and end identical to an uninterrupted run.

The stage functions run in a subprocess that SIGKILLs itself at a point the test picks
(EAGLE3_FAULT_KILL_AFTER_CHUNKS / EAGLE3_FAULT_KILL_MID_CHUNK, see resume.ChunkStore).
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from eagle3_pipeline.config import validate_config
from eagle3_pipeline.generation import render_prompt_ids
from eagle3_pipeline.shards import read_shard, read_shard_header

ROOT = Path(__file__).resolve().parents[1]


def run_py(code: str, env_extra: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "EAGLE3_LOCK_DIR": str(cwd or "/tmp") + "/locks", **(env_extra or {})}
    wf = str(ROOT / "workflow_scripts")
    head = f"import logging, sys\nsys.path.insert(0, {wf!r})\nlogging.basicConfig(level=logging.INFO)\nif __name__ == '__main__':\n"
    script = head + textwrap.indent(textwrap.dedent(code), "    ")
    # output goes to files, not pipes: processes orphaned by a SIGKILL keep inherited pipes open
    d = Path(cwd or "/tmp")
    with open(d / "stdout.txt", "w") as out, open(d / "stderr.txt", "w") as err:
        rc = subprocess.run([sys.executable, "-c", script], env=env, stdout=out, stderr=err, cwd=cwd).returncode
    return subprocess.CompletedProcess([], rc, (d / "stdout.txt").read_text(), (d / "stderr.txt").read_text())


@pytest.fixture(scope="module")
def traces(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("traces")
    rng = np.random.default_rng(0)
    recs = []
    for i in range(10):
        p = render_prompt_ids(tokenizer, [{"role": "user", "content": f"Question number {i}?"}])
        c = rng.integers(100, 40000, size=int(rng.integers(20, 120))).tolist()
        recs.append({"id": f"{i:016x}", "prompt_token_ids": p, "completion_token_ids": c})
    path = d / "shard-00000.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def extract_code(traces, out: Path, target) -> str:
    cfg = validate_config({"extraction": {"chunk_samples": 3, "batch_tokens": 4096}})["extraction"]
    return f"""
    from eagle3_pipeline.hidden_states import run_extraction_shard
    run_extraction_shard({str(traces)!r}, {str(out / "shard-00000.safetensors")!r}, {str(out / "shard-00000.index.json")!r},
                         {str(target)!r}, {cfg!r}, max_seq_len=2048, trust_remote_code=False)
    """


@pytest.fixture(scope="module")
def reference_extraction(tmp_path_factory, traces, target_dir):
    out = tmp_path_factory.mktemp("ref")
    r = run_py(extract_code(traces, out, target_dir), cwd=out)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_killed_extraction_resumes_to_identical_output(tmp_path, traces, target_dir, reference_extraction):
    """Killed after its first chunk, then its rerun killed while writing its second (a chunk not yet
    in place), then, with a byte of its second done chunk flipped on disk, run to the end: that
    chunk is extracted again and the shard equals one uninterrupted job's, byte for byte in its
    tensors. Three engine starts cover both kill points and a resumed run resumed again."""
    code = extract_code(traces, tmp_path, target_dir)
    partial = tmp_path / ".shard-00000.safetensors.partial"
    for fault, kept in (({"EAGLE3_FAULT_KILL_AFTER_CHUNKS": "1"}, 1), ({"EAGLE3_FAULT_KILL_MID_CHUNK": "2"}, 2)):
        r = run_py(code, fault, cwd=tmp_path)
        assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
        assert not (tmp_path / "shard-00000.safetensors").exists()  # nothing that looks finished
        # the chunk written when the kill came is not in place
        assert sorted(p.name for p in partial.glob("chunk-*.done")) == [f"chunk-{i:06d}.done" for i in range(kept)]
    assert "1 of 4 chunks already finished" in r.stderr  # the second run resumed the first's
    # one byte of done chunk 1 flipped on disk since its marker: that chunk alone is extracted again
    first_row = json.loads((partial / "chunk-000001.done").read_text())["rows"][0][0]
    prefix, header = read_shard_header(partial / "shard.safetensors")
    (a, b), rows = header["hidden_states"]["data_offsets"], header["hidden_states"]["shape"][0]
    flip = len(prefix) + a + first_row * (b - a) // rows + 7
    with open(partial / "shard.safetensors", "r+b") as f:
        f.seek(flip)
        byte = f.read(1)[0]
        f.seek(flip)
        f.write(bytes([byte ^ 0x01]))
    r = run_py(code, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"done chunk 1 is extracted again: rows {first_row}-" in r.stderr
    assert "1 of 4 chunks already finished" in r.stderr
    index = json.loads((tmp_path / "shard-00000.index.json").read_text())
    assert index["chunks_resumed"] == 1 and not partial.exists()
    # hashed while it was filled, across three processes: the SHA-256 of the finished bytes
    for out in (tmp_path, reference_extraction):
        shard = out / "shard-00000.safetensors"
        assert json.loads((out / "shard-00000.index.json").read_text())["sha256"] == hashlib.sha256(shard.read_bytes()).hexdigest()
    got, ref = read_shard(tmp_path / "shard-00000.safetensors"), read_shard(reference_extraction / "shard-00000.safetensors")
    assert [s.id for s in got[0]] == [s.id for s in ref[0]]  # order by trace, no duplicates, none lost
    for a, b in zip(got[1], ref[1], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(got[0], ref[0], strict=True):
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)


def test_a_full_disk_at_the_index_keeps_the_finished_shard_for_the_rerun(tmp_path, traces, target_dir, reference_extraction):
    """The index is written after the shard is renamed into place; when that write fails (a full
    disk), the shard goes back into the chunk store, so the rerun resumes every chunk instead of
    extracting again what Snakemake deleted with the failed job's outputs."""
    full = """
    import errno
    import eagle3_pipeline.shard_job as sj
    real = sj.write_json_atomic
    def write(path, *a, **k):
        if str(path).endswith(".index.json"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, *a, **k)
    sj.write_json_atomic = write
    """
    code = extract_code(traces, tmp_path, target_dir)
    r = run_py(full + code, cwd=tmp_path)
    assert r.returncode == 1 and "No space left on device" in r.stderr, r.stderr[-3000:]
    assert "could not be written; its finished chunks are kept for the rerun" in r.stderr
    partial = tmp_path / ".shard-00000.safetensors.partial"
    assert not (tmp_path / "shard-00000.safetensors").exists() and not (tmp_path / "shard-00000.index.json").exists()
    assert len(list(partial.glob("chunk-*.done"))) == 4 and (partial / "shard.safetensors").is_file()
    r = run_py(code, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "4 of 4 chunks already finished" in r.stderr
    assert (tmp_path / "shard-00000.safetensors").read_bytes() == (reference_extraction / "shard-00000.safetensors").read_bytes()
    index = json.loads((tmp_path / "shard-00000.index.json").read_text())
    assert (
        index["chunks_resumed"] == 4
        and index["sha256"] == json.loads((reference_extraction / "shard-00000.index.json").read_text())["sha256"]
    )


def test_a_shard_finished_by_a_job_that_outlived_its_snakemake_is_kept(tmp_path, traces, target_dir, reference_extraction, monkeypatch):
    """snakemake killed alone leaves its job running with the host-wide lock; the rerun's job waits, and
    counts chunks only once the lock is its own: it keeps the shard the other job finished meanwhile."""
    import shutil
    import time

    from eagle3_pipeline.hygiene import host_lock

    monkeypatch.setenv("EAGLE3_LOCK_DIR", str(tmp_path / "locks"))
    head = f"import logging, sys\nsys.path.insert(0, {str(ROOT / 'workflow_scripts')!r})\nlogging.basicConfig(level=logging.INFO)\n"
    script = head + "if __name__ == '__main__':\n" + textwrap.indent(textwrap.dedent(extract_code(traces, tmp_path, target_dir)), "    ")
    with host_lock(), open(tmp_path / "err.txt", "w") as err:  # the other job holds the lock
        job = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=err, cwd=tmp_path)
        deadline = time.monotonic() + 120
        while "waiting for the host-wide full-model lock" not in (tmp_path / "err.txt").read_text():
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "err.txt").read_text()[-2000:]
            time.sleep(0.5)
        for name in ("shard-00000.safetensors", "shard-00000.index.json"):  # the other job finishes the shard
            shutil.copy2(reference_extraction / name, tmp_path / name)
    assert job.wait(timeout=300) == 0, (tmp_path / "err.txt").read_text()[-3000:]
    log = (tmp_path / "err.txt").read_text()
    assert "finished by another job of these outputs while this one waited for its lock; keeping its output" in log
    for name in ("shard-00000.safetensors", "shard-00000.index.json"):  # not extracted again (its timings would differ)
        assert (tmp_path / name).read_bytes() == (reference_extraction / name).read_bytes()
    assert not (tmp_path / ".shard-00000.safetensors.partial").exists()


@pytest.mark.e2e
def test_killed_generation_resumes_to_identical_traces(tmp_path, target_dir, one_engine_traces):
    ref = one_engine_traces  # 6 prompts in 3 chunks, from one engine that ran to the end

    def code(out: Path) -> str:
        o = {k: str(out / f"{k}.jsonl") for k in ("traces", "rejects")} | {"summary": str(out / "summary.json")}
        return f"""
        from eagle3_pipeline.generation import run_generation_shard
        run_generation_shard({str(ref.prompts)!r}, {o!r}, {str(target_dir)!r}, {ref.params!r}, chunk_prompts={ref.chunk_prompts})
        """

    killed = tmp_path / "killed"
    killed.mkdir()
    r = run_py(code(killed), {"EAGLE3_FAULT_KILL_AFTER_CHUNKS": "2"}, cwd=killed)
    assert r.returncode == -signal.SIGKILL and not (killed / "traces.jsonl").exists()
    # the killed stage's vLLM engine processes outlive it; its pid record names them
    record = json.loads((tmp_path / ".pids" / "traces.json").read_text())
    orphans = [psutil.Process(c["pid"]) for c in record["children"] if psutil.pid_exists(c["pid"])]
    assert orphans
    r = run_py(code(killed), cwd=killed)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 of 3 chunks already finished (4 records), 1 to do" in r.stderr
    assert "left by a killed stage" in r.stderr
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in orphans)
    assert not (tmp_path / ".pids" / "traces.json").exists()
    got = [json.loads(x) for x in (killed / "traces.jsonl").read_text().splitlines()]
    assert [t["id"] for t in got] == [t["id"] for t in ref.traces]
    assert [t["completion_token_ids"] for t in got] == [t["completion_token_ids"] for t in ref.traces]
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["chunks_resumed"] == 2 and summary["ok"] == 6


def test_kept_work_names_finished_chunks_and_training_checkpoints(tmp_path):
    """What the onerror hint lists: finished chunks per store (not specs or temp files), checkpoint steps."""
    from eagle3_pipeline.resume import ChunkStore, kept_work

    run = tmp_path / "results" / "r"
    gen = ChunkStore(run / "traces" / "shard-00000.jsonl", "fp", ".jsonl")
    for i in (0, 2):
        with gen.writing(i) as tmp:
            tmp.write_text("{}\n")
    (gen.dir / ".chunk-000003.jsonl.x.tmp").write_text("half")
    ext = ChunkStore(run / "hidden_states" / "shard-00000.safetensors", "fp", ".done")
    (ext.dir / "chunk-000000.done").write_text("{}")
    (ext.dir / "chunk-000000.done.spec.json").write_text("{}")
    (ext.dir / "chunk-000001.done.spec.json").write_text("{}")  # submitted, not done
    started = ChunkStore(run / "hidden_states" / "shard-00001.safetensors", "fp", ".done")  # no chunk finished: not named
    (started.dir / "chunk-000000.done.spec.json").write_text("{}")
    ckpt = run / "sweep" / "v1" / "train" / ".checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "progress.json").write_text(json.dumps({"step": 61, "total_steps": 122, "epoch": 1, "tokens_seen": 5}))
    bad = run / "train" / ".checkpoint"
    bad.mkdir(parents=True)
    (bad / "progress.json").write_text("{")
    assert kept_work(run) == [
        f"1 finished chunk(s) of {run / 'hidden_states' / 'shard-00000.safetensors'}",
        f"2 finished chunk(s) of {run / 'traces' / 'shard-00000.jsonl'}",
        f"training checkpoint at step 61/122 in {ckpt} (used if the training's inputs and settings are unchanged)",
        f"training checkpoint in {bad} (progress.json unreadable)",
    ]
    assert kept_work(tmp_path / "nothing") == []


def test_a_shard_finished_after_its_snakemake_was_killed_is_taken_back_by_the_rerun(
    tmp_path, traces, target_dir, reference_extraction, monkeypatch
):
    """kill -9 of snakemake alone: its job finishes the shard; the rerun deletes the outputs Snakemake marked
    incomplete, and its job takes the finished shard back from the chunk store instead of extracting again."""
    import time

    from eagle3_pipeline.hygiene import host_lock

    monkeypatch.setenv("EAGLE3_LOCK_DIR", str(tmp_path / "locks"))
    head = f"import logging, sys\nsys.path.insert(0, {str(ROOT / 'workflow_scripts')!r})\nlogging.basicConfig(level=logging.INFO)\n"
    script = head + "if __name__ == '__main__':\n" + textwrap.indent(textwrap.dedent(extract_code(traces, tmp_path, target_dir)), "    ")
    (tmp_path / "job.py").write_text(script)
    # a stand-in for snakemake: starts the job, then waits; killed with SIGKILL while the job runs
    parent = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, {str(tmp_path / 'job.py')!r}])\ntime.sleep(600)\n"
    err = tmp_path / "err.txt"
    with host_lock(), open(err, "w") as f:  # hold the job at its start (its ancestors are recorded by then)
        snake = subprocess.Popen([sys.executable, "-c", parent], env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=f, cwd=tmp_path)
        deadline = time.monotonic() + 120
        while "waiting for the host-wide full-model lock" not in err.read_text():
            assert snake.poll() is None and time.monotonic() < deadline, err.read_text()[-2000:]
            time.sleep(0.5)
        job = next(p for p in psutil.Process(snake.pid).children() if "job.py" in " ".join(p.cmdline()))
        snake.kill()
        snake.wait()
    job.wait(timeout=300)
    log = err.read_text()
    assert "the snakemake that started this job has ended" in log, log[-3000:]
    index = json.loads((tmp_path / "shard-00000.index.json").read_text())
    partial = tmp_path / ".shard-00000.safetensors.partial"
    assert (partial / "finished-shard-00000.safetensors").samefile(tmp_path / "shard-00000.safetensors")
    for name in ("shard-00000.safetensors", "shard-00000.index.json"):  # what the rerun's Snakemake deletes first
        (tmp_path / name).unlink()
    r = run_py(extract_code(traces, tmp_path, target_dir), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "taken back from" in r.stderr and "resuming" not in r.stderr
    assert json.loads((tmp_path / "shard-00000.index.json").read_text()) == index  # the finished job's record, not a new run's
    got, ref = read_shard(tmp_path / "shard-00000.safetensors"), read_shard(reference_extraction / "shard-00000.safetensors")
    for a, b in zip(got[1], ref[1], strict=True):
        assert torch.equal(a, b)
    assert not partial.exists()
