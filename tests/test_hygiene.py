"""Host-wide full-model lock, disk preflight and resumable chunk stores."""

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eagle3_pipeline.hygiene import check_disk, hidden_state_bytes, host_lock
from eagle3_pipeline.io import InputError
from eagle3_pipeline.resume import ChunkStore, chunk_ranges, todo_chunks

ROOT = Path(__file__).resolve().parents[1]


def _holder(tmp_path: Path, seconds: float, marker: str, lock: str = "host_lock(poll_seconds=0.1)") -> subprocess.Popen:
    code = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(ROOT / "workflow_scripts")!r})
        from eagle3_pipeline.hygiene import host_lock, output_lock
        with {lock}:
            open({str(tmp_path / marker)!r}, "a").write(f"start {{time.time()}}\\n")
            time.sleep({seconds})
            open({str(tmp_path / marker)!r}, "a").write(f"end {{time.time()}}\\n")
        """
    )
    output = str(tmp_path / "train" / "summary.json")  # output_lock's output
    return subprocess.Popen([sys.executable, "-c", code, output], env={"EAGLE3_LOCK_DIR": str(tmp_path / "locks"), "PATH": "/usr/bin:/bin"})


def _interval(path: Path) -> tuple[float, float]:
    d = dict(line.split() for line in path.read_text().splitlines())
    return float(d["start"]), float(d["end"])


# the host-wide lock, and the lock of one output (a training's, beside it: hygiene.output_lock_path)
LOCKS = ["host_lock(poll_seconds=0.1)", "output_lock(sys.argv[1], poll_seconds=0.1)"]


@pytest.mark.parametrize("lock", LOCKS)
def test_two_processes_never_hold_the_host_lock_together(tmp_path, lock):
    a = _holder(tmp_path, 1.5, "a", lock)
    time.sleep(0.5)
    b = _holder(tmp_path, 0.2, "b", lock)
    assert a.wait(30) == 0 and b.wait(30) == 0
    (a0, a1), (b0, b1) = _interval(tmp_path / "a"), _interval(tmp_path / "b")
    assert a0 < a1 <= b0 < b1  # b waited for a


def test_a_killed_holder_releases_the_lock(tmp_path):
    a = _holder(tmp_path, 60, "a")
    while not (tmp_path / "a").exists():
        time.sleep(0.05)
    a.kill()  # SIGKILL: no cleanup code runs
    a.wait()
    b = _holder(tmp_path, 0.1, "b")
    assert b.wait(10) == 0 and (tmp_path / "b").read_text().count("end") == 1


def test_disabled_lock_does_not_block(tmp_path, monkeypatch):
    """A disabled lock (cluster jobs) neither waits for the lock's holder nor touches the lock
    directory; the enabled one waits (checked in a thread, so that a broken lock fails, not hangs)."""
    import threading

    monkeypatch.setenv("EAGLE3_LOCK_DIR", str(tmp_path / "locks"))
    with host_lock(enabled=False):
        assert not (tmp_path / "locks").exists()

    def nested(enabled: bool, done: list) -> None:
        with host_lock(enabled=enabled, poll_seconds=0.1):
            done.append(enabled)

    with host_lock():  # held here: flock excludes another open file description, in this process too
        done: list = []
        for enabled in (False, True):
            t = threading.Thread(target=nested, args=(enabled, done), daemon=True)
            t.start()
            t.join(2)
        assert done == [False]  # the disabled one went through; the enabled one waits
    t.join(5)
    assert done == [False, True]  # and goes through once the lock is free


def test_disk_preflight_refuses_with_both_numbers(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**12, 0, 2 * 10**9))
    need = hidden_state_bytes(1_000_000, 4, 4096, 2)  # 1M tokens, 4 layers x 4096 x bf16
    assert need == 1_000_000 * (4 * 4096 * 2 + 9)
    with pytest.raises(InputError, match=r"needs about 32\.78 GB but .* has 2\.00 GB free; .*extraction\.disk_preflight: false"):
        check_disk(tmp_path / "results" / "x", need, what="extraction", override_key="extraction.disk_preflight")
    check_disk(tmp_path, 10**9, what="extraction", override_key="extraction.disk_preflight")


def test_chunk_store_keeps_finished_chunks_and_drops_them_when_inputs_change(tmp_path):
    final = tmp_path / "out" / "shard-00000.jsonl"
    ranges = chunk_ranges(10, 4)
    assert ranges == [(0, 4), (4, 8), (8, 10)]
    s = ChunkStore(final, "fp1", ".jsonl")
    with s.writing(1) as tmp:
        tmp.write_text("chunk 1\n")
    (s.dir / ".chunk-000002.jsonl.x.tmp").write_text("half written")  # a kill mid-write
    s = ChunkStore(final, "fp1", ".jsonl")
    assert s.finished() == [1] and todo_chunks(s, ranges) == [0, 2]
    assert not list(s.dir.glob(".*.tmp"))
    s = ChunkStore(final, "fp2", ".jsonl")  # other inputs or settings
    assert s.finished() == [] and todo_chunks(s, ranges) == [0, 1, 2]
    s.remove()
    assert not s.dir.exists()


def _fake_smi(tmp_path, monkeypatch, apps: str):
    import os

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(
        '#!/bin/sh\ncase "$1" in --query-compute-apps*) printf "%s" "$APPS";; --query-gpu*) printf "0, GPU-aaa\\n1, GPU-bbb\\n";; esac\n'
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("APPS", apps)


def test_busy_gpus_fail_fast_naming_pids_and_commands(tmp_path, monkeypatch):
    import os
    import subprocess

    from eagle3_pipeline.hygiene import check_gpus_free, gpu_processes

    me, parent = os.getpid(), os.getppid()
    other = subprocess.Popen(["sleep", "60"])  # a live process that is not this one's ancestor
    try:
        _fake_smi(
            tmp_path, monkeypatch, f"{me}, python, 71000, GPU-bbb\n{other.pid}, vllm, 120000, GPU-aaa\n{parent}, pytest, 500, GPU-aaa\n"
        )
        assert [p["pid"] for p in gpu_processes()] == [me, other.pid, parent]
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
        assert [p["pid"] for p in gpu_processes()] == [other.pid, parent]  # only the GPUs this job may use
        # the other process is named; this process's ancestors (e.g. the caller) are not
        with pytest.raises(RuntimeError, match=rf"in use by:\n  pid {other.pid} \(120000 MiB on GPU-aaa\)[^\n]*\nstop"):
            check_gpus_free()
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
        check_gpus_free()  # only this process on GPU 1
    finally:
        other.kill()
        other.wait()


def test_no_nvidia_smi_means_no_gpu_check(monkeypatch):
    from eagle3_pipeline.hygiene import check_gpus_free, gpu_processes

    monkeypatch.setenv("PATH", "/nonexistent")
    assert gpu_processes() == []
    check_gpus_free()


def test_broken_nvidia_smi_means_no_gpu_check(tmp_path, monkeypatch):
    import os

    from eagle3_pipeline.hygiene import gpu_processes

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.' >&2\nexit 9\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:{os.environ['PATH']}")
    assert gpu_processes() == []


@pytest.mark.parametrize("interrupt", [True, False])
def test_a_ctrl_c_ends_a_job_with_one_line_not_tracebacks(tmp_path, interrupt):
    """The engine gets the same SIGINT and dies first; what the job then raises (vLLM's EngineDeadError,
    RuntimeError: cancelled) is reported in one line. Without a Ctrl-C an error keeps its traceback."""
    code = f"""
    import os, signal, sys, time
    sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / "workflow_scripts")!r})
    from eagle3_pipeline.runtime import start_log
    start_log(None)

    def engine_step():
        try:
            if {interrupt!r}:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            raise ValueError("a real error")
        except KeyboardInterrupt:
            raise RuntimeError("cancelled")

    engine_step()
    """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    if interrupt:
        assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert (
            "interrupted (Ctrl-C / SIGINT): stopped (RuntimeError); finished chunks and checkpoints are kept, rerun to resume" in r.stderr
        )
    else:
        assert "Traceback" in r.stderr and "ValueError: a real error" in r.stderr


def test_bad_input_ends_a_job_with_its_message_not_a_traceback():
    """An InputError (the user's to fix) that ends a job is logged as its message and notes; the exit
    status stays 1, so Snakemake still sees the job fail."""
    code = f"""
    import sys
    sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / "workflow_scripts")!r})
    from eagle3_pipeline.runtime import start_log
    from eagle3_pipeline.prompts import split_shards
    start_log(None)
    try:
        split_shards([{{"id": "a"}}], 3)
    except ValueError as e:
        e.add_note("while splitting prompts")
        raise
    """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0].endswith("ERROR eagle3_pipeline: 1 prompt cannot fill 3 shards; lower prompts.num_shards to at most 1")
    assert lines[1:] == ["while splitting prompts"]


def test_git_holds_no_run_output():
    """Runs write under results/, logs/ and resources/ (ignored); benchmarks/ in git is scripts,
    their README and recorded figures only."""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("not a git checkout")
    files = r.stdout.splitlines()
    assert not [f for f in files if f.split("/")[0] in ("results", "logs", "resources", ".snakemake")]
    allowed = re.compile(r"benchmarks/([a-z0-9_]+\.(py|sh)|README\.md|results/[a-z0-9_]+\.json)")
    assert [f for f in files if f.startswith("benchmarks/") and not allowed.fullmatch(f)] == []


def test_recorded_figures_are_not_ignored():
    """A benchmark's recorded figures (benchmarks/results/*.json) can be committed: an ignore rule
    for the run folder `results/` written without its leading slash also matched
    benchmarks/results/, and two H200 records were lost that way (never added, never noticed)."""
    root = Path(__file__).resolve().parents[1]
    paths = ["benchmarks/results/new_figures_h200.json", "benchmarks/new_script.py", "benchmarks/README.md"]
    r = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=root, capture_output=True, text=True)
    if r.returncode == 128:
        pytest.skip("not a git checkout")
    assert r.stdout.split() == []  # check-ignore prints the paths it would ignore
    runs = ["results/default/summary.json", "logs/default/x.log", "resources/models/m/config.json"]
    r = subprocess.run(["git", "check-ignore", "--no-index", *runs], cwd=root, capture_output=True, text=True)
    assert r.stdout.split() == runs


def test_no_file_dates_itself_by_a_work_session():
    """Code and docs say when (a date) and how (a command), never which work session: a
    reader cannot look a session number up."""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("not a git checkout")
    pattern = re.compile(r"\bsess" + r"ion\s+\d", re.IGNORECASE)  # split, so this file does not match itself
    hits = []
    for f in r.stdout.splitlines():
        path = root / f
        if path.suffix in (".py", ".md", ".smk", ".yaml", ".yml", ".sh", ".rst", ".txt", ".toml") or path.name in ("Snakefile", "Makefile"):
            hits += [f"{f}:{i}" for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if pattern.search(line)]
    assert hits == []


def test_a_filesystem_without_flock_runs_the_block_with_a_warning(tmp_path, monkeypatch, caplog):
    """Some Lustre mounts refuse flock (ENOSYS): the training beside its outputs still runs."""
    import errno
    import fcntl
    import logging

    from eagle3_pipeline.hygiene import output_lock, output_lock_path

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    ran = []
    with caplog.at_level(logging.WARNING), output_lock(tmp_path / "train" / "summary.json"):
        ran.append(True)
    assert ran == [True] and output_lock_path(tmp_path / "train" / "summary.json") == tmp_path / "train" / ".summary.json.lock"
    assert "cannot be taken on this filesystem" in caplog.text and "Function not implemented" in caplog.text


def test_a_job_that_did_none_of_the_work_records_no_rate():
    """A resumed shard whose chunks were all finished before records its rate as not measured (None),
    not as 0 tokens/s."""
    from eagle3_pipeline.runtime import rate

    assert rate(1500, 4.0) == 375.0
    assert rate(0, 0.0) is None and rate(1500, 0.0) is None
