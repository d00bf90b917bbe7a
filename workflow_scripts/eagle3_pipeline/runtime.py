"""Per-job runtime plumbing: the job's log file, progress bars, stage metrics.

Rule scripts call :func:`start_log` first thing so that everything the job prints,
including output of child processes (vLLM's engine core runs in a spawned process),
lands in the rule's ``log:`` file.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, TextIO

from tqdm import tqdm

logger = logging.getLogger("eagle3_pipeline")

_interrupted = False  # set by the SIGINT handler of handle_interrupts


def _on_sigint(signum, frame) -> None:
    global _interrupted
    _interrupted = True
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: Python's default
    raise KeyboardInterrupt


def interrupted() -> bool:
    """Whether this process received SIGINT (Ctrl-C) since :func:`handle_interrupts`."""
    return _interrupted


def interrupted_line(exc: BaseException) -> str:
    """The one line a job's log gets instead of tracebacks when a Ctrl-C stops it (its vLLM engine,
    which got the same signal, may have died first: ``EngineDeadError``, ``RuntimeError: cancelled``)."""
    return f"interrupted (Ctrl-C / SIGINT): stopped ({type(exc).__name__}); finished chunks and checkpoints are kept, rerun to resume"


def _excepthook(kind, value, tb) -> None:
    from .io import InputError

    if _interrupted:
        logger.error(interrupted_line(value))
        return
    if issubclass(kind, InputError):  # the user's to fix: the message says where and what to do
        logger.error("\n".join([str(value), *getattr(value, "__notes__", [])]))
        return
    sys.__excepthook__(kind, value, tb)


def handle_interrupts() -> None:
    """A Ctrl-C ends this job with one log line (:func:`interrupted_line`), not the tracebacks of
    whatever was running: the SIGINT handler records it, and an exception that ends the process
    after it is reported in one line. An :class:`eagle3_pipeline.io.InputError` that ends the
    process (bad input, whose message names the file or setting and what to do) is logged as its
    message and notes alone, without the traceback that would bury it; any other error keeps its
    traceback. Called by :func:`start_log` and :func:`start_replica_log`."""
    global _interrupted
    _interrupted = False
    signal.signal(signal.SIGINT, _on_sigint)
    sys.excepthook = _excepthook


def start_log(log_path: str | os.PathLike | None) -> None:
    """Send this process's stdout/stderr (file descriptors 1 and 2) to ``log_path``.

    The descriptors are duplicated, so processes spawned later (vLLM engine workers)
    inherit the log too. Also configures :mod:`logging` at INFO with timestamps.
    ``None`` leaves the streams alone (interactive use, tests).
    """
    if log_path is not None:
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        f = open(log_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (lives for the job)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        sys.stdout = f
        sys.stderr = f
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    handle_interrupts()


def start_replica_log(rank: int) -> None:
    """Configure :mod:`logging` in a data-parallel replica process (:mod:`eagle3_pipeline.parallel`).

    The replica inherited the job's stdout/stderr (the job log); its lines carry a
    ``[replica r]`` prefix.
    """
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [replica {rank}] %(name)s: %(message)s",
        force=True,
    )
    handle_interrupts()


class _LineWriter:
    """File-like wrapper turning tqdm's carriage-return redraws into whole lines.

    A log file that is tailed then shows one readable line per refresh instead of
    ``\\r``-separated fragments.
    """

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, s: str) -> None:
        for part in s.replace("\r", "\n").split("\n"):
            if part.strip():
                self.stream.write(part.rstrip() + "\n")

    def flush(self) -> None:
        self.stream.flush()


class _Bar(tqdm):
    """A tqdm bar whose shown rate, and so its ETA, is ``rate_source()`` when one is given (an
    attribute its owner may replace, e.g. by the mean rate once the work is done)."""

    def __init__(self, *args: Any, rate_source: Callable[[], float | None] | None = None, **kw: Any) -> None:
        self.rate_source = rate_source  # set first: tqdm's constructor may already print
        super().__init__(*args, **kw)

    @property
    def format_dict(self) -> dict:
        d = super().format_dict
        if self.rate_source is not None:
            d["rate"] = self.rate_source() or 0.0  # 0: tqdm shows the rate and the ETA as "?"
        return d


def progress(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    rate_source: Callable[[], float | None] | None = None,
    **kw: Any,
) -> tqdm:
    """A tqdm progress bar with rate and ETA.

    On a terminal it redraws in place; otherwise (a log file) it prints a full line
    at most every 30 seconds, which doubles as a heartbeat for cluster logs.

    Args:
        rate_source: units/s to show, and to take the ETA from, each time the bar prints (None
            or 0: not known yet, shown as "?"); default: tqdm's own smoothed rate, which a log
            file's bar updates only when it prints.
    """
    tty = sys.stderr.isatty()
    return _Bar(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr if tty else _LineWriter(sys.stderr),
        mininterval=0.5 if tty else 30.0,
        dynamic_ncols=tty,
        ncols=None if tty else 100,
        ascii=not tty,
        rate_source=rate_source,
        **kw,
    )


def rate(count: float, seconds: float) -> float | None:
    """``count`` per second over ``seconds`` of a job's work, for its summary; None (not measured)
    where the job did none of the work (``seconds`` 0: a resumed job whose chunks were all finished
    by an earlier one), rather than a rate of 0 that reads as a stall."""
    return count / seconds if seconds > 0 else None


class Timer:
    """Wall-clock stopwatch in seconds (``time.perf_counter``)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start


def peak_memory() -> dict:
    """Peak memory of this stage so far, for its metrics file.

    Returns:
        ``peak_rss_bytes``: this process (Linux ``ru_maxrss``); ``peak_child_rss_bytes``:
        the largest finished child process (a vLLM engine core or worker, a replica), 0 if
        none; ``peak_gpu_allocated_bytes``: what torch allocated on the GPU in this process
        (``torch.cuda.max_memory_allocated``), None when this process did not use CUDA
        (vLLM's GPU memory is its engine's, reported in its log).
    """
    import resource
    import sys

    torch = sys.modules.get("torch")
    gpu = torch.cuda.max_memory_allocated() if torch is not None and torch.cuda.is_initialized() else None
    return {
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_child_rss_bytes": int(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) * 1024,
        "peak_gpu_allocated_bytes": gpu,
    }


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes (Linux ``ru_maxrss``)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
