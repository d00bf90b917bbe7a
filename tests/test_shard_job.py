"""The resumable per-shard job runner (shard_job.run_shard_job) with a fake worker: no engine, no model.

The worker writes each chunk's items as lines of a chunk file and logs which chunks it did; the
job's output is the chunks joined in order.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from eagle3_pipeline import shard_job
from eagle3_pipeline.io import file_stat, sha256_file, write_json_atomic, write_text_atomic
from eagle3_pipeline.layout import RunLayout
from eagle3_pipeline.resume import ChunkStore
from eagle3_pipeline.shard_job import ShardJob, ShardRun, run_shard_job

ROOT = Path(__file__).resolve().parents[1]
ITEMS = [f"item-{k}" for k in range(10)]  # 4 chunks of 3: 0-2, 3-5, 6-8, 9
EVERY_ITEM = "".join(x + "\n" for x in ITEMS)


def fake_worker(job: dict, rank: int, chunks) -> None:
    """One replica: each chunk's items, one a line, into the store; ``skip`` leaves a chunk undone."""
    store = ChunkStore.attach(job["out"], ".txt")
    did = []
    for i in chunks:
        if i == job.get("skip"):
            continue
        a, b = job["ranges"][i]
        with store.writing(i) as tmp:
            tmp.write_text("".join(x + "\n" for x in job["items"][a:b]))
            with open(job["calls"], "a") as f:  # before the chunk is in place: a kill after it loses no line
                f.write(json.dumps({"rank": rank, "chunk": i}) + "\n")
        did.append(i)
    write_json_atomic(
        store.dir / f"replica-{rank}.json",
        {"rank": rank, "chunks": len(did), "model_load_seconds": 0.5 + rank, "work_seconds": 1.0 + rank, "items": len(did)},
    )


def make_job(run_dir: Path, fingerprint: str = "fp-1", *, keep_finished: bool = False, replicas: int = 1, **worker_job) -> ShardJob:
    """A job of ``ITEMS`` whose output is ``<run_dir>/stage/shard-00000.txt`` (so its process records
    are ``<run_dir>/.pids``), its record ``shard-00000.json`` beside it."""
    out = run_dir / "stage" / "shard-00000.txt"
    out.parent.mkdir(parents=True, exist_ok=True)

    def assemble(run: ShardRun) -> dict:
        write_text_atomic(out, "".join(run.store.path(i).read_text() for i in range(len(run.ranges))))
        return {"items": len(ITEMS), "work_seconds": run.stats.get("work_seconds", 0.0), "sha256": sha256_file(out), "stat": file_stat(out)}

    return ShardJob(
        outputs=[str(out)],
        record=str(out.with_suffix(".json")),
        fingerprint=fingerprint,
        chunk_suffix=".txt",
        num_items=len(ITEMS),
        chunk_size=3,
        worker=fake_worker,
        worker_job={"items": ITEMS, "out": str(out), "calls": str(run_dir / "calls.jsonl")} | worker_job,
        assemble=assemble,
        replicas=replicas,
        keep_finished=keep_finished,
    )


def calls(run_dir: Path) -> list[int]:
    """The chunks the workers did so far, in the order they finished them."""
    path = run_dir / "calls.jsonl"
    return [json.loads(x)["chunk"] for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(autouse=True)
def lock_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_LOCK_DIR", str(tmp_path / "locks"))  # not the host's: another run may hold it


@pytest.fixture
def gpu_checks(monkeypatch) -> list[int]:
    """Counts the GPU checks (one per run that starts replicas)."""
    checks: list[int] = []
    monkeypatch.setattr(shard_job, "check_gpus_free", lambda: checks.append(1))
    return checks


def dead_snakemake() -> list[tuple[int, float]]:
    """``ancestors()`` of a job whose snakemake has ended: a process that ran and was killed."""
    p = subprocess.Popen(["sleep", "60"])
    t = psutil.Process(p.pid).create_time()
    p.kill()
    p.wait()
    return [(p.pid, t)]


def partial_dir(run_dir: Path) -> Path:
    """The chunk store of :func:`make_job`'s job (without opening it)."""
    return run_dir / "stage" / ".shard-00000.txt.partial"


def test_a_job_does_every_chunk_assembles_in_order_and_writes_its_record_last(tmp_path, gpu_checks):
    job = make_job(tmp_path)
    rec = run_shard_job(job)
    assert calls(tmp_path) == [0, 1, 2, 3] and gpu_checks == [1]
    assert Path(job.outputs[0]).read_text() == EVERY_ITEM
    assert json.loads(Path(job.record).read_text()) == rec
    assert {k: rec[k] for k in ("items", "chunks", "chunks_resumed", "data_parallel_size", "replicas_per_gpu", "fingerprint")} == {
        "items": 10,
        "chunks": 4,
        "chunks_resumed": 0,
        "data_parallel_size": 1,
        "replicas_per_gpu": 1,
        "fingerprint": "fp-1",
    }
    assert rec["model_load_seconds"] == 0.5 and rec["work_seconds"] == 1.0 and rec["peak_rss_bytes"] > 0
    assert rec["replicas"] == [{"rank": 0, "chunks": 4, "model_load_seconds": 0.5, "work_seconds": 1.0, "items": 4}]
    assert not partial_dir(tmp_path).exists()  # the store is removed


def test_a_killed_job_resumes_only_the_missing_chunks(tmp_path, gpu_checks):
    code = (
        f"import sys; sys.path[:0] = [{str(ROOT / 'workflow_scripts')!r}, {str(ROOT / 'tests')!r}]\n"
        "from pathlib import Path\n"
        "from eagle3_pipeline.shard_job import run_shard_job\n"
        "from test_shard_job import make_job\n"
        f"run_shard_job(make_job(Path({str(tmp_path)!r})))\n"
    )
    env = {**os.environ, "EAGLE3_FAULT_KILL_AFTER_CHUNKS": "2"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    job = make_job(tmp_path)
    assert not Path(job.outputs[0]).exists() and not Path(job.record).exists()
    assert calls(tmp_path) == [0, 1] and job.open_store().finished() == [0, 1]
    rec = run_shard_job(job)
    assert calls(tmp_path) == [0, 1, 2, 3]  # the rerun did chunks 2 and 3 alone
    assert rec["chunks_resumed"] == 2 and rec["replicas"][0]["chunks"] == 2
    assert Path(job.outputs[0]).read_text() == EVERY_ITEM  # as an uninterrupted run's


def test_chunks_of_another_fingerprint_are_done_again(tmp_path, gpu_checks):
    store = make_job(tmp_path, "fp-old").open_store()
    with store.writing(0) as tmp:
        tmp.write_text("stale\n")
    rec = run_shard_job(make_job(tmp_path, "fp-new"))
    assert calls(tmp_path) == [0, 1, 2, 3] and rec["chunks_resumed"] == 0
    assert (tmp_path / "stage" / "shard-00000.txt").read_text() == EVERY_ITEM


def test_a_shard_another_job_finished_while_this_one_waited_is_kept(tmp_path, gpu_checks, monkeypatch):
    """The job of a snakemake killed alone holds the host-wide lock and finishes the shard while this
    job waits: this one keeps that output, does no chunk, and removes the chunks that job kept."""
    import contextlib

    job = make_job(tmp_path)
    with job.open_store().writing(0) as tmp:  # kept by the other job for a rerun
        tmp.write_text("item-0\nitem-1\nitem-2\n")
    theirs = {"items": 10, "fingerprint": "fp-1", "by": "the other job"}

    @contextlib.contextmanager
    def lock_held_meanwhile(enabled=True):
        Path(job.outputs[0]).write_text(EVERY_ITEM)  # while this job waited
        write_json_atomic(job.record, theirs)
        yield

    monkeypatch.setattr(shard_job, "host_lock", lock_held_meanwhile)
    assert run_shard_job(job) == theirs
    assert calls(tmp_path) == [] and gpu_checks == []
    assert json.loads(Path(job.record).read_text()) == theirs
    assert not partial_dir(tmp_path).exists()
    # another fingerprint (other inputs or settings): not this job's result, the work is done
    other = make_job(tmp_path, "fp-2")
    assert run_shard_job(other)["fingerprint"] == "fp-2" and calls(tmp_path) == [0, 1, 2, 3]


def test_stale_engines_are_ended_before_the_store_is_opened(tmp_path, gpu_checks, monkeypatch, caplog):
    """A killed job's engine may still write into the store: it is ended before the store is opened
    (which drops a killed writer's temporary files) and its chunks counted, even with none to do."""
    job = make_job(tmp_path)
    store = job.open_store()
    for i in range(4):  # every chunk kept: no replica runs
        with store.writing(i) as tmp:
            tmp.write_text("".join(x + "\n" for x in ITEMS[3 * i : 3 * i + 3]))
    half = store.dir / ".chunk-000004.txt.x.tmp"
    half.write_text("half")  # what the stale engine was writing
    engine = subprocess.Popen(["sleep", "60"])
    stage, start = dead_snakemake()[0]  # the killed job's process
    pids = tmp_path / ".pids"
    pids.mkdir()
    write_json_atomic(
        pids / "shard-00000.json",
        {
            "pid": stage,
            "create_time": start,
            "children": [{"pid": engine.pid, "create_time": psutil.Process(engine.pid).create_time(), "name": "sleep"}],
        },
    )
    seen = []
    real = shard_job.cleanup_stale_processes

    def cleanup(pid_dir):
        seen.append((Path(pid_dir), half.exists()))
        return real(pid_dir, grace_seconds=5)

    monkeypatch.setattr(shard_job, "cleanup_stale_processes", cleanup)
    rec = run_shard_job(job)
    assert seen == [(pids, True)]  # before the store was opened
    engine.wait(timeout=10)  # ended (psutil reaped it: no exit status left for Popen)
    assert f"ending pid {engine.pid} (sleep) left by a killed stage" in caplog.text and not (pids / "shard-00000.json").exists()
    assert rec["chunks_resumed"] == 4 and calls(tmp_path) == [] and gpu_checks == []
    assert Path(job.outputs[0]).read_text() == EVERY_ITEM


def test_without_keep_finished_the_chunks_are_kept_for_the_rerun_when_snakemake_ended(tmp_path, gpu_checks, monkeypatch):
    monkeypatch.setattr(shard_job, "ancestors", dead_snakemake)
    job = make_job(tmp_path)
    run_shard_job(job)
    store = job.open_store()
    assert store.finished() == [0, 1, 2, 3] and not list(store.dir.glob("finished-*"))
    monkeypatch.setattr(shard_job, "ancestors", lambda: [])
    for p in (job.outputs[0], job.record):  # the rerun's Snakemake deletes them as incomplete
        Path(p).unlink()
    rec = run_shard_job(job)
    assert rec["chunks_resumed"] == 4 and calls(tmp_path) == [0, 1, 2, 3]  # assembled again, no replica ran
    assert gpu_checks == [1] and not store.dir.exists()
    assert Path(job.outputs[0]).read_text() == EVERY_ITEM


def test_with_keep_finished_the_rerun_takes_the_finished_output_back(tmp_path, gpu_checks, monkeypatch):
    monkeypatch.setattr(shard_job, "ancestors", dead_snakemake)
    job = make_job(tmp_path, keep_finished=True)
    first = run_shard_job(job)
    store = job.open_store()
    assert (store.dir / "finished-shard-00000.txt").samefile(job.outputs[0])
    monkeypatch.setattr(shard_job, "ancestors", lambda: [])
    for p in (job.outputs[0], job.record):  # the rerun's Snakemake deletes them as incomplete
        Path(p).unlink()
    assert run_shard_job(job) == first  # the finished job's record, not a new run's
    assert calls(tmp_path) == [0, 1, 2, 3] and gpu_checks == [1] and not store.dir.exists()
    assert Path(job.outputs[0]).read_text() == EVERY_ITEM


def test_an_altered_kept_output_is_not_taken_back(tmp_path, gpu_checks, monkeypatch, caplog):
    monkeypatch.setattr(shard_job, "ancestors", dead_snakemake)
    job = make_job(tmp_path, keep_finished=True)
    run_shard_job(job)
    monkeypatch.setattr(shard_job, "ancestors", lambda: [])
    with open(job.outputs[0], "a") as f:  # the kept hard link sees it too
        f.write("tampered\n")
    for p in (job.outputs[0], job.record):
        Path(p).unlink()
    rec = run_shard_job(job)
    assert "not taking back the kept output" in caplog.text and "taken back from" not in caplog.text  # one word, not both
    assert calls(tmp_path) == [0, 1, 2, 3] * 2 and rec["chunks_resumed"] == 0  # done again, from no chunk
    assert Path(job.outputs[0]).read_text() == EVERY_ITEM


def test_a_chunk_the_replicas_left_undone_is_an_error_and_the_others_are_kept(tmp_path, gpu_checks):
    job = make_job(tmp_path, skip=2)
    with pytest.raises(RuntimeError, match=r"chunk\(s\) \[2\] were not done; rerun the job to resume"):
        run_shard_job(job)
    assert job.open_store().finished() == [0, 1, 3] and not Path(job.outputs[0]).exists()
    rec = run_shard_job(make_job(tmp_path))
    assert calls(tmp_path) == [0, 1, 3, 2] and rec["chunks_resumed"] == 3


@pytest.mark.processes
def test_data_parallel_replicas_share_the_chunks(tmp_path, gpu_checks):
    rec = run_shard_job(make_job(tmp_path, replicas=2))
    assert sorted(calls(tmp_path)) == [0, 1, 2, 3]  # each chunk once
    # a replica that found every chunk taken started no engine and wrote no timings
    assert rec["data_parallel_size"] == 2 and {r["rank"] for r in rec["replicas"]} <= {0, 1}
    assert sum(r["chunks"] for r in rec["replicas"]) == 4
    assert rec["model_load_seconds"] == max(r["model_load_seconds"] for r in rec["replicas"])  # the slowest replica's
    assert (tmp_path / "stage" / "shard-00000.txt").read_text() == EVERY_ITEM


def test_too_few_chunks_for_the_replicas_are_named_with_the_size_that_balances_them():
    """The H200 answers run: 3,000 prompts in chunks of 2,048 on 2 replicas; one replica can get
    the 2,048-prompt chunk while the other does 952: a chunk size of 750 gives each 2 chunks."""
    ranges = [(0, 2048), (2048, 3000)]
    msg = shard_job.balance_warning(ranges, [0, 1], 2, "generation.chunk_prompts")
    assert msg == (
        "2 chunk(s) of up to 2048 items for 2 replicas: one replica may do 2048 of 3000 items while an even share is 1500; "
        "set generation.chunk_prompts to at most 750 to keep every replica busy"
    )
    # 750 each: 4 chunks, 2 per replica, no warning
    assert shard_job.balance_warning([(a, a + 750) for a in range(0, 3000, 750)], [0, 1, 2, 3], 2, "k") is None
    # 3 replicas, 5 chunks of 10 to do (the others kept): one replica may take 2 of them
    msg = shard_job.balance_warning([(a, a + 10) for a in range(0, 100, 10)], [5, 6, 7, 8, 9], 3, "extraction.chunk_samples")
    assert msg.startswith("5 chunk(s) of up to 10 items for 3 replicas: one replica may do 20 of 50 items while an even share is 17;")
    assert msg.endswith("set extraction.chunk_samples to at most 8 to keep every replica busy")
    assert shard_job.balance_warning(ranges, [0, 1], 1, "k") is None  # one replica: nothing to balance
    assert shard_job.balance_warning(ranges, [], 2, "k") is None  # nothing to do


def test_a_finished_job_kept_before_its_rerun_is_taken_back_and_not_when_altered_or_changed(tmp_path, gpu_checks):
    """The snakemake that ran a job was killed after the job ended but before it cleared its incomplete
    marks: the onstart hook keeps the outputs (keep_for_rerun) before Snakemake deletes them, and the
    rerun's job takes them back; an altered output is not kept, and other settings redo the work."""
    job = make_job(tmp_path, keep_finished=True)
    first = run_shard_job(job)
    assert not partial_dir(tmp_path).exists()  # an ordinary end: nothing kept
    assert shard_job.keep_for_rerun(job.outputs, job.record, job.check_outputs)
    for p in (job.outputs[0], job.record):  # what the rerun's Snakemake deletes as incomplete
        Path(p).unlink()
    assert run_shard_job(job) == first and calls(tmp_path) == [0, 1, 2, 3]  # taken back, no chunk done again
    assert Path(job.outputs[0]).read_text() == EVERY_ITEM and not partial_dir(tmp_path).exists()
    # altered after its job recorded it: not kept (and nothing of it is)
    Path(job.outputs[0]).write_text("item-0\n")
    assert not shard_job.keep_for_rerun(job.outputs, job.record, job.check_outputs) and not partial_dir(tmp_path).exists()
    # kept, but the rerun's settings differ (another fingerprint): the work is done again
    Path(job.outputs[0]).write_text(EVERY_ITEM)
    write_json_atomic(job.record, first | {"sha256": sha256_file(job.outputs[0]), "stat": file_stat(job.outputs[0])})
    assert shard_job.keep_for_rerun(job.outputs, job.record, job.check_outputs)
    for p in (job.outputs[0], job.record):
        Path(p).unlink()
    rec = run_shard_job(make_job(tmp_path, "fp-2", keep_finished=True))
    assert rec["fingerprint"] == "fp-2" and calls(tmp_path) == [0, 1, 2, 3] * 2 and rec["chunks_resumed"] == 0
    # no record, or a record without a fingerprint: nothing to keep
    Path(job.record).unlink()
    assert not shard_job.keep_for_rerun(job.outputs, job.record, job.check_outputs)


def test_a_jobs_recorded_ancestors_stop_at_its_snakemake(tmp_path):
    """``nohup snakemake ... &`` from a shell that then exits: that shell's end must not make every
    job of the run look orphaned (its store kept, a warning that its snakemake ended). The chain a
    job records stops at the nearest snakemake process (here a stand-in named ``snakemake``, started
    by a shell); a job function called with no snakemake above records every ancestor."""
    code = (
        f"import json, sys; sys.path.insert(0, {str(ROOT / 'workflow_scripts')!r}); "
        "from eagle3_pipeline.resume import ancestors; print(json.dumps(ancestors()))"
    )
    fake = tmp_path / "bin" / "snakemake"
    fake.parent.mkdir()
    fake.write_text(
        f"#!{sys.executable}\nimport os, subprocess, sys\nprint(os.getpid(), flush=True)\nsubprocess.run([sys.executable, '-c', {code!r}], check=True)\n"
    )
    fake.chmod(0o755)
    out = subprocess.run(["bash", "-c", f"{fake}; true"], capture_output=True, text=True, check=True).stdout.splitlines()
    snakemake_pid, chain = int(out[0]), json.loads(out[1])
    assert [pid for pid, _ in chain] == [snakemake_pid]
    direct = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert [pid for pid, _ in direct][:2] == [os.getpid(), os.getppid()]


def test_the_start_keeps_each_stages_finished_outputs_by_their_own_record(tmp_path, monkeypatch):
    """The onstart step (snakemake_adapter.keep_incomplete_finished_shards) with every output marked
    incomplete: a trace shard (its summary's traces_sha256), a hidden-state shard (its index's
    sha256) and a drafter folder (its record of files) are each kept under their record's
    fingerprint; an altered shard, a job whose outputs are not all marked, and other stages are not."""
    from eagle3_pipeline import snakemake_adapter
    from eagle3_pipeline.generation import SUMMARY_HASH_KEYS
    from eagle3_pipeline.io import record_files
    from eagle3_pipeline.resume import ChunkStore
    from eagle3_pipeline.shards import INDEX_HASH_KEYS

    def finished(main: Path, record: Path, keys: tuple[str, str], text: str) -> None:
        main.write_text(text)
        write_json_atomic(record, {"fingerprint": f"fp-{main.name}", keys[0]: sha256_file(main), keys[1]: file_stat(main)})

    traces, summary = tmp_path / "shard-00000.jsonl", tmp_path / "shard-00000.summary.json"
    finished(traces, summary, SUMMARY_HASH_KEYS, "trace\n")
    altered, altered_summary = tmp_path / "shard-00001.jsonl", tmp_path / "shard-00001.summary.json"
    finished(altered, altered_summary, SUMMARY_HASH_KEYS, "trace\n")
    altered.write_text("edited\n")
    shard, index = tmp_path / "shard-00000.safetensors", tmp_path / "shard-00000.index.json"
    finished(shard, index, INDEX_HASH_KEYS, "states")
    layout = RunLayout.at(tmp_path / "run")  # training's record is the layout's, not found by its name
    drafter, metrics, train_summary = Path(layout.drafter()), Path(layout.train_metrics()), Path(layout.train_summary())
    sweep = layout.variant("ttt1")  # a sweep variant's training: its record under its own folder
    v_drafter, v_metrics, v_summary = Path(sweep.drafter()), Path(sweep.train_metrics()), Path(sweep.train_summary())
    for d, m, summ, fp in ((drafter, metrics, train_summary, "fp-train"), (v_drafter, v_metrics, v_summary, "fp-ttt1")):
        d.mkdir(parents=True)
        m.parent.mkdir()
        (d / "model.safetensors").write_text("weights")
        record_files(d)
        m.write_text("{}\n")
        write_json_atomic(summ, {"fingerprint": fp})
    jobs = [
        {"stage": "generate_traces", "output": [str(traces), str(tmp_path / "r0.jsonl"), str(summary)]},
        {"stage": "generate_traces", "output": [str(altered), str(tmp_path / "r1.jsonl"), str(altered_summary)]},
        {"stage": "extract_hidden_states", "output": [str(shard), str(index)]},
        {"stage": "train_drafter", "output": [str(drafter), str(metrics), str(train_summary)]},
        {"stage": "train_drafter", "output": [str(v_drafter), str(v_metrics), str(v_summary)], "wildcards": {"variant": "ttt1"}},
        {"stage": "evaluate_drafter", "output": [str(tmp_path / "acceptance.json")]},
    ]
    for j in jobs[:2]:
        Path(j["output"][1]).write_text("")
    marked = {o for j in jobs for o in j["output"]}
    monkeypatch.setattr(snakemake_adapter, "incomplete_outputs", lambda _wf: marked)
    assert snakemake_adapter.keep_incomplete_finished_shards(None, jobs, layout) == [str(traces), str(shard), str(drafter), str(v_drafter)]
    for main, record, fp in (
        (traces, summary, "fp-shard-00000.jsonl"),
        (shard, index, "fp-shard-00000.safetensors"),
        (drafter, train_summary, "fp-train"),
        (v_drafter, v_summary, "fp-ttt1"),
    ):
        kept = ChunkStore.dir_for(main)
        assert (kept / "FINGERPRINT").read_text() == fp + "\n"  # the fingerprint its record names
        assert (kept / f"finished-{record.name}").samefile(record)
        link = kept / f"finished-{main.name}"
        assert (link / "model.safetensors").samefile(main / "model.safetensors") if main.is_dir() else link.samefile(main)
    assert (ChunkStore.dir_for(drafter) / "finished-metrics.jsonl").samefile(metrics)
    assert not ChunkStore.dir_for(altered).exists()
    marked -= {str(metrics), str(v_metrics)}  # not all of the training's outputs marked: its job had not finished
    for main in (traces, shard, drafter, v_drafter):
        shutil.rmtree(ChunkStore.dir_for(main))
    assert snakemake_adapter.keep_incomplete_finished_shards(None, jobs, layout) == [str(traces), str(shard)]
