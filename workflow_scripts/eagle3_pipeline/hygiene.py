"""Host hygiene for full-model stages: a host-wide lock, a lock per output and a disk preflight.

Snakemake's ``full_model`` resource serializes full-model jobs within one invocation;
two invocations on the same host (two runs, two users) do not see each other's
resources. :func:`host_lock` closes that gap with an advisory ``flock`` on a lock file
shared by every run on the host; the kernel releases it when the holder exits, killed
or not, so a crashed run never leaves a stale lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from .io import InputError

logger = logging.getLogger(__name__)

#: Default directory of host-wide lock files (override with EAGLE3_LOCK_DIR).
DEFAULT_LOCK_DIR = "/tmp/eagle3-pipeline-locks"


def lock_dir() -> Path:
    """Directory of host-wide lock files: ``$EAGLE3_LOCK_DIR`` or :data:`DEFAULT_LOCK_DIR`."""
    return Path(os.environ.get("EAGLE3_LOCK_DIR", DEFAULT_LOCK_DIR))


@contextlib.contextmanager
def host_lock(name: str = "full-model", *, enabled: bool = True, poll_seconds: float = 5.0) -> Iterator[None]:
    """Hold the host-wide lock ``name`` for the duration of the block.

    Blocks until the lock is free, logging who holds it (pid and command written into
    the lock file by the holder) every ``poll_seconds``. ``enabled=False`` (cluster
    runs, where each job owns its GPUs) is a no-op.
    """
    if not enabled:
        yield
        return
    d = lock_dir()
    d.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(PermissionError):
        os.chmod(d, 0o1777)  # shared by every user of the host, like /tmp
    with _flock(d / f"{name}.lock", f"the host-wide {name} lock", poll_seconds):
        yield


def output_lock_path(output: str | os.PathLike) -> Path:
    """The lock file of a job's output: ``.<name>.lock`` beside it (not an output itself)."""
    p = Path(output)
    return p.parent / f".{p.name}.lock"


@contextlib.contextmanager
def output_lock(output: str | os.PathLike, *, poll_seconds: float = 5.0) -> Iterator[None]:
    """Hold the lock of ``output`` (:func:`output_lock_path`) for the duration of the block.

    Two jobs that write the same outputs never run at once: the job of a snakemake that was
    killed alone lives on, and its rerun's job waits here until it ends (then keeps what it
    finished, or resumes from its checkpoint). The lock file lives beside the output, so it
    also holds across the nodes of a cluster whose shared filesystem supports ``flock``.
    """
    path = output_lock_path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _flock(path, f"the lock of {output}", poll_seconds):
        yield


@contextlib.contextmanager
def _flock(path: Path, what: str, poll_seconds: float) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created), waited for with a log line naming the holder
    every minute; the holder's pid and command are written into the file. On a filesystem without
    ``flock`` (some Lustre mounts raise ENOSYS) the block runs without the lock, with a warning."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        waited = 0.0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if waited == 0.0 or waited % 60 < poll_seconds:
                    holder = Path(path).read_text(errors="replace").strip() or "unknown"
                    logger.info("waiting for %s %s, held by %s", what, path, holder)
                time.sleep(poll_seconds)
                waited += poll_seconds
            except OSError as e:  # not a lock held by another process: the filesystem has no flock
                logger.warning("%s: %s cannot be taken on this filesystem (%s); going on without it", path, what, e)
                yield
                return
        if waited:
            logger.info("acquired %s after %.0f s", what, waited)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: {' '.join(_cmdline())}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def _cmdline() -> list[str]:
    try:
        return Path("/proc/self/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1][:4]
    except OSError:
        return ["?"]


def check_disk(path: str | os.PathLike, need_bytes: int, *, what: str, override_key: str) -> None:
    """Refuse to start when ``need_bytes`` will not fit on the filesystem of ``path``.

    Raises:
        InputError: with both numbers and the config key that skips the check.
    """
    p = Path(path)
    while not p.exists():
        p = p.parent
    free = shutil.disk_usage(p).free
    if need_bytes > free:
        raise InputError(
            f"{what} needs about {need_bytes / 1e9:.2f} GB but {p} has {free / 1e9:.2f} GB free; "
            f"free space or move results/, or set {override_key}: false to skip this check"
        )
    logger.info("disk preflight: %s needs ~%.2f GB, %.2f GB free on %s", what, need_bytes / 1e9, free / 1e9, p)


def hidden_state_bytes(num_tokens: int, num_layers: int, hidden_size: int, dtype_bytes: int) -> int:
    """Bytes of stored hidden states: tokens × layers × hidden × bytes per element.

    The ids, loss mask and offsets add ~9 bytes per token, included here.
    """
    return num_tokens * (num_layers * hidden_size * dtype_bytes + 9)


class ProcessRecord:
    """A pidfile of the processes a stage started (vLLM's engine core and workers).

    A stage records its child processes once its engine is up and clears the record
    after shutting the engine down. If the stage is killed (SIGKILL cannot be caught),
    the record stays and the next full-model stage of the run calls
    :func:`cleanup_stale_processes`, which ends exactly those processes — identified by
    pid *and* start time, so a reused pid is never hit, and never by name.
    """

    def __init__(self, pid_dir: str | os.PathLike, name: str):
        self.path = Path(pid_dir) / f"{name}.json"

    def record(self) -> None:
        import psutil

        from .io import write_json_atomic

        me = psutil.Process()
        kids = [{"pid": c.pid, "create_time": c.create_time(), "name": c.name()} for c in me.children(recursive=True)]
        write_json_atomic(self.path, {"pid": me.pid, "create_time": me.create_time(), "children": kids})

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


def cleanup_stale_processes(pid_dir: str | os.PathLike, grace_seconds: float = 5.0) -> list[int]:
    """End processes left by killed stages of this run (see :class:`ProcessRecord`).

    Records whose stage process is still alive belong to a running stage and are left
    alone. Returns the pids that were ended (SIGTERM, then SIGKILL after ``grace_seconds``).
    """
    import json

    import psutil

    ended: list[int] = []
    for f in sorted(Path(pid_dir).glob("*.json")) if Path(pid_dir).is_dir() else []:
        rec = json.loads(f.read_text())
        if same_process(rec["pid"], rec["create_time"]):
            continue  # that stage is still running
        procs = [psutil.Process(c["pid"]) for c in rec["children"] if same_process(c["pid"], c["create_time"])]
        for p in procs:
            logger.warning("ending pid %d (%s) left by a killed stage (record %s)", p.pid, p.name(), f)
            with contextlib.suppress(psutil.NoSuchProcess):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=grace_seconds)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        ended += [p.pid for p in procs]
        f.unlink(missing_ok=True)
    return ended


def same_process(pid: int, create_time: float) -> bool:
    """Whether process ``pid`` still runs and is the one started at ``create_time`` (psutil's
    seconds since the epoch): a pid reused since has another start time."""
    import psutil

    try:
        return abs(psutil.Process(pid).create_time() - create_time) < 1e-3
    except psutil.NoSuchProcess:
        return False


def gpu_processes() -> list[dict]:
    """Compute processes on the visible GPUs: ``[{"pid", "name", "used_mib", "gpu_uuid", "cmdline"}]``.

    Read with ``nvidia-smi --query-compute-apps``; an empty list where there is no
    working ``nvidia-smi`` (CPU machines). ``CUDA_VISIBLE_DEVICES`` restricts the GPUs (indices
    or UUIDs).
    """
    import subprocess

    import psutil

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    q = subprocess.run(
        [smi, "--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
    )
    if q.returncode != 0:  # a CUDA toolkit without a driver or GPU
        logger.debug("nvidia-smi failed (%s); no GPU check", q.stderr.strip())
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    uuids = None
    if visible:
        g = subprocess.run([smi, "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True, text=True, check=True)
        pairs = [tuple(x.strip() for x in line.split(",")) for line in g.stdout.splitlines() if line.strip()]
        want = {v.strip() for v in visible.split(",")}
        uuids = {u for i, u in pairs if i in want or u in want}
    out = []
    for line in q.stdout.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) < 4 or not parts[0].isdigit():
            continue
        pid, name, used, uuid = int(parts[0]), parts[1], parts[2], parts[3]
        if uuids is not None and uuid not in uuids:
            continue
        try:
            cmd = " ".join(psutil.Process(pid).cmdline()) or name
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            cmd = name
        out.append({"pid": pid, "name": name, "used_mib": int(used) if used.isdigit() else None, "gpu_uuid": uuid, "cmdline": cmd})
    return out


def check_gpus_free() -> None:
    """Fail fast when other processes hold memory on the GPUs this stage will use.

    This process and its ancestors are not counted: they are alive and running this
    stage (e.g. a test runner or notebook that called the stage function), not a
    leftover such as a vLLM server or a killed stage's engine.

    Raises:
        RuntimeError: listing each pid, its memory and command line, and what to do.
    """
    import psutil

    own = {os.getpid()} | {a.pid for a in psutil.Process().parents()}
    procs = [p for p in gpu_processes() if p["pid"] not in own]
    if procs:
        lines = "\n".join(f"  pid {p['pid']} ({p['used_mib']} MiB on {p['gpu_uuid']}): {p['cmdline']}" for p in procs)
        raise RuntimeError(
            "the GPUs this full-model stage needs are in use by:\n"
            + lines
            + "\nstop those processes (e.g. a vLLM server left running) and rerun"
        )
