"""Data parallelism inside one full-model job: independent replicas of the target.

vLLM has no offline data parallelism for dense models (``LLM(data_parallel_size>1)``
raises; its ``data_parallel_offline`` example starts one process per replica). A
generation or extraction job with ``data_parallel_size = D`` does the same: it starts
D replica processes (``multiprocessing`` spawn), gives replica ``r`` its own slice of
the job's GPUs through ``CUDA_VISIBLE_DEVICES`` (GPUs ``r*g .. r*g+g-1`` of the visible
ones, ``g`` = GPUs per replica, i.e. tensor × pipeline parallel size), and lets them
take the job's resumable chunks (:mod:`eagle3_pipeline.resume`) from one queue, so a
fast replica takes more chunks. Each chunk is written atomically by whichever replica
did it; the job assembles the final output in chunk order, so the result does not
depend on D (for deterministic decoding) and a killed job resumes with any D.

A target too small to keep a GPU busy from one engine (a 135M target decoding 1,000
sequences kept an H200 19% busy: vLLM's scheduler and output processing are per-request
Python, one CPU core per engine) can run ``replicas_per_gpu = R`` replicas on each GPU:
replica ``r`` takes GPU ``r // R``, each engine gets the GPU's memory share divided by the
engines on it (:func:`memory_share`), and the engines of one GPU start and stop one at a time
(:func:`engine_turn`), so vLLM's memory profiling of one never sees another's start or the
memory another releases (vLLM fails its start when free memory grows while it profiles: seen
on an H200 when one replica finished the job's last chunks while the other was starting). A
replica that finds no chunk left starts no engine. An engine that is already decoding can
still grow while the next one profiles; vLLM then counts that as the new engine's memory (a
smaller KV cache), which did not show on an H200.

Across nodes, data parallelism is Snakemake's: ``prompts.num_shards = K`` gives K
independent jobs, each its own model load, which a cluster runs on K nodes at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import math
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


def visible_gpus() -> list[str]:
    """The GPUs this job may use: ``CUDA_VISIBLE_DEVICES`` entries, else every GPU ``nvidia-smi -L`` lists.

    Returns an empty list on a machine without NVIDIA GPUs. Does not initialise CUDA
    (replica processes must be free to choose their devices).
    """
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    q = subprocess.run([smi, "-L"], capture_output=True, text=True)
    if q.returncode != 0:
        return []
    return [str(i) for i, line in enumerate(q.stdout.splitlines()) if line.startswith("GPU ")]


def replica_gpus(num_replicas: int, gpus_per_replica: int, replicas_per_gpu: int = 1) -> int:
    """GPUs a job of ``num_replicas`` replicas of ``gpus_per_replica`` GPUs needs, ``replicas_per_gpu`` on each GPU.

    ``ceil(D / R) × g``: the ``gpu`` resource of a generation or extraction job
    (``rules/common.smk``) and what :func:`replica_devices` checks the visible GPUs against.
    """
    return math.ceil(num_replicas / replicas_per_gpu) * gpus_per_replica


def replica_devices(num_replicas: int, gpus_per_replica: int, visible: Sequence[str], replicas_per_gpu: int = 1) -> list[str | None]:
    """``CUDA_VISIBLE_DEVICES`` of each replica: consecutive slices of ``visible``.

    Args:
        num_replicas: data-parallel size D (≥ 1).
        gpus_per_replica: GPUs of one replica g (tensor × pipeline parallel size).
        visible: the job's GPUs (:func:`visible_gpus`); empty on a CPU machine, where
            every replica gets ``None`` (no device restriction).
        replicas_per_gpu: R replicas share each GPU (replica ``r`` on GPU ``r // R``);
            only for one-GPU replicas (g = 1).

    Returns:
        one entry per replica: ``"2,3"`` (its GPUs) or ``None`` on a CPU machine.

    Raises:
        ValueError: fewer than ``ceil(D / R) × g`` GPUs are visible, or R > 1 with g > 1.
    """
    if replicas_per_gpu > 1 and gpus_per_replica > 1:
        raise ValueError(
            f"replicas_per_gpu {replicas_per_gpu} shares one GPU between replicas, but a replica uses "
            f"{gpus_per_replica} GPUs (tensor x pipeline parallel); set vllm.replicas_per_gpu to 1"
        )
    if not visible:
        return [None] * num_replicas
    need = replica_gpus(num_replicas, gpus_per_replica, replicas_per_gpu)
    if need > len(visible):
        per = f" ({replicas_per_gpu} per GPU)" if replicas_per_gpu > 1 else ""
        raise ValueError(
            f"data_parallel_size {num_replicas}{per} x {gpus_per_replica} GPU(s) per replica needs {need} GPUs, "
            f"but this job sees {len(visible)} ({','.join(visible)}); lower the parallel sizes or give the job more GPUs"
        )
    return [
        ",".join(visible[(r // replicas_per_gpu) * gpus_per_replica : (r // replicas_per_gpu + 1) * gpus_per_replica])
        for r in range(num_replicas)
    ]


#: The lock of this replica's GPU, held while an engine on it starts, when replicas share
#: that GPU (set in each spawned replica by :func:`run_replicas`; ``None`` otherwise).
_START_LOCK = None
#: Replicas on this replica's GPU (1 unless replicas share GPUs).
_SHARING = 1


def memory_share(gpu_memory_utilization: float) -> float:
    """This replica's part of ``gpu_memory_utilization`` (a fraction of the GPU's memory, 0-1).

    Args:
        gpu_memory_utilization: the configured share of the GPU for all its engines.

    Returns:
        the fraction divided by the number of replicas that :func:`run_replicas` put on this
        process's GPU; unchanged outside such a replica (a job's own process, evaluation) or
        where replicas have GPUs of their own. vLLM's ``gpu_memory_utilization`` is one
        engine's share, so the engines on a GPU together keep the configured one.
    """
    return gpu_memory_utilization / _SHARING


@contextlib.contextmanager
def engine_turn() -> Iterator[None]:
    """Wrap an engine's construction and its shutdown: replicas that share a GPU start and stop
    their engines one at a time.

    vLLM sizes its KV cache from the GPU memory it sees change while it profiles
    (``vllm.v1.worker.gpu_worker``); another engine starting on the same GPU at that moment
    makes the numbers wrong, and one stopping fails the check that free memory never grows
    ("Error in memory profiling ... other processes sharing the same container release GPU
    memory"). Each GPU has its own lock, so engines on different GPUs start side by side;
    waiting has no timeout (a replica that dies holding the lock releases it, and the job
    stops the others). A no-op where replicas have GPUs of their own, and in a job's own process.
    """
    if _START_LOCK is None:
        yield
        return
    with _START_LOCK:
        yield


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux
        pass


def _queue_iter(queue) -> Iterator[int]:
    while (item := queue.get()) is not None:
        yield item


def replica_items(queue) -> Iterator[int] | None:
    """A replica's items from the job's shared ``queue`` (items, then one ``None`` per replica).

    Returns:
        an iterator that starts with the item taken now, or ``None`` when the queue holds no
        item for this replica (others took them all): the replica then starts no engine,
        which would only take memory from, and release it under, an engine starting beside it.
    """
    first = queue.get()
    return None if first is None else itertools.chain([first], _queue_iter(queue))


def _replica_main(worker: Callable, rank: int, devices: str | None, queue, start_lock=None, sharing: int = 1) -> None:
    global _START_LOCK, _SHARING
    _die_with_parent()
    _START_LOCK, _SHARING = start_lock, sharing
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    from .runtime import interrupted, interrupted_line, start_replica_log

    start_replica_log(rank)
    items = replica_items(queue)
    if items is None:
        logger.info("no chunk left for this replica: it starts no engine")
        return
    try:
        worker(rank, items)
    except BaseException as e:  # multiprocessing prints a traceback itself, not through sys.excepthook
        if not interrupted():
            raise
        logger.error(interrupted_line(e))
        raise SystemExit(130) from None


def run_replicas(
    worker: Callable[[int, Iterator[int]], None],
    items: Sequence[int],
    num_replicas: int,
    gpus_per_replica: int,
    replicas_per_gpu: int = 1,
) -> None:
    """Run ``worker(rank, items_iterator)`` on ``num_replicas`` replicas sharing ``items``.

    With one replica the worker runs in this process (no spawn), restricted to the first
    ``gpus_per_replica`` visible GPUs (``CUDA_VISIBLE_DEVICES``, set before CUDA starts; the
    callers initialise no CUDA before). Otherwise each replica
    is a spawned process (``worker`` must be picklable: a module-level function or a
    ``functools.partial`` of one) that dies with this process, and pulls items from a
    shared queue until it is empty; replicas never take the same item. Replicas log to
    this process's stderr (the job log) with a ``[replica r]`` prefix. With
    ``replicas_per_gpu = R > 1``, up to R replicas share each GPU (:func:`replica_devices`)
    and the engines of one GPU start and stop one at a time (:func:`engine_turn`, :func:`memory_share`).
    When fewer items than replicas remain, fewer replicas start, spread over the
    ``ceil(num_replicas / R)`` GPUs the job has before any GPU takes a second one.

    Raises:
        ValueError: not enough GPUs for the replicas, or R > 1 with multi-GPU replicas
            (:func:`replica_devices`).
        RuntimeError: a replica failed (its exit code named); the others are stopped.
            Items it finished are kept by the caller's chunk store.
    """
    if len(items) < num_replicas:
        logger.info("%d chunk(s) to do: starting %d of %d replicas", len(items), max(len(items), 1), num_replicas)
        gpus = replica_gpus(num_replicas, 1, replicas_per_gpu)  # the job's GPU slices: use them all first
        num_replicas = max(len(items), 1)
        replicas_per_gpu = math.ceil(num_replicas / gpus)
    visible = visible_gpus()
    if num_replicas == 1:
        if len(visible) > gpus_per_replica:  # use the GPUs the job declared, not every GPU of the host
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible[:gpus_per_replica])
            logger.info(
                "one replica on %d of %d visible GPUs: CUDA_VISIBLE_DEVICES=%s",
                gpus_per_replica,
                len(visible),
                os.environ["CUDA_VISIBLE_DEVICES"],
            )
        worker(0, iter(items))
        return
    devices = replica_devices(num_replicas, gpus_per_replica, visible, replicas_per_gpu)
    ctx = mp.get_context("spawn")
    # one start lock per GPU that several replicas share (on a CPU machine: all of them, if asked)
    locks = {d: ctx.Lock() for d in set(devices) if (devices.count(d) > 1 if d is not None else replicas_per_gpu > 1)}
    queue = ctx.Queue()
    for item in items:
        queue.put(item)
    for _ in range(num_replicas):
        queue.put(None)
    procs = [
        ctx.Process(
            target=_replica_main,
            args=(worker, r, devices[r], queue, locks.get(devices[r]), devices.count(devices[r]) if devices[r] else 1),
            name=f"replica-{r}",
        )
        for r in range(num_replicas)
    ]
    for r, p in enumerate(procs):
        p.start()
        logger.info("replica %d: pid %d, CUDA_VISIBLE_DEVICES=%s", r, p.pid, devices[r] if devices[r] is not None else "(cpu)")
    failed: list[tuple[int, int]] = []
    try:
        pending = set(range(num_replicas))
        while pending:
            for r in sorted(pending):
                procs[r].join(timeout=1.0)
                if procs[r].exitcode is not None:
                    pending.discard(r)
                    if procs[r].exitcode != 0:
                        failed.append((r, procs[r].exitcode))
            if failed:
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if failed:
        r, code = failed[0]
        raise RuntimeError(f"data-parallel replica {r} failed (exit code {code}); its log lines above say why; finished chunks are kept")


def replica_stats(store_dir: Path) -> dict:
    """Timing of a job's replicas (``replica-*.json`` in its chunk store), combined.

    Returns ``{"model_load_seconds", "<work>_seconds", ...}`` where seconds are the
    slowest replica's (replicas run side by side) and counts are summed, plus
    ``"replicas"``: the per-replica records (where fields that are not numbers, such as the
    ``vllm`` backend's ``writer`` figures, stay per replica). Empty when no replica ran.
    """
    import json

    recs = [json.loads(p.read_text()) for p in sorted(store_dir.glob("replica-*.json"))]
    if not recs:
        return {}
    out: dict = {"replicas": recs}
    for k in recs[0]:
        vals = [r.get(k) for r in recs]
        if k == "rank" or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals):
            continue
        out[k] = max(vals) if k.endswith("seconds") else sum(vals)
    return out
