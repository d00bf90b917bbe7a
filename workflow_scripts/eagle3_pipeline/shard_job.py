"""The resumable per-shard job: one runner for generation and extraction.

A per-shard job (generate_traces, extract_hidden_states) makes one output from one input shard,
in chunks of a fixed size that survive a killed job (:mod:`eagle3_pipeline.resume`), on one or
more engine replicas (:mod:`eagle3_pipeline.parallel`). Its lifecycle is the same for both
stages and lives here, in :func:`run_shard_job`:

1. take the host-wide full-model lock (:func:`eagle3_pipeline.hygiene.host_lock`);
2. keep the output that another job of this shard finished while this one waited
   (:func:`eagle3_pipeline.resume.finished_by_another_job`);
3. end the engine processes a killed earlier job of the run left, then open the chunk store;
4. take back the output this shard's job finished after its snakemake ended, when the stage
   keeps finished outputs (:meth:`eagle3_pipeline.resume.ChunkStore.take_finished`);
5. prepare the store (extraction preallocates its partial shard) and count the chunks to do;
6. check that the GPUs are free and run the replicas on those chunks, with what the stage
   follows them with (extraction hashes its shard as chunks finish);
7. check that every chunk is done, assemble the output, write the record (summary or index) last;
8. remove the store, or keep it for the rerun when this job's snakemake has ended
   (:meth:`eagle3_pipeline.resume.ChunkStore.finish`).

A stage says only what a chunk is (its replica worker and the worker's job dict), how to prepare
the store and how to assemble the output: a :class:`ShardJob`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .hygiene import check_gpus_free, cleanup_stale_processes, host_lock
from .io import InputError, read_json, recorded_sha256, write_json_atomic
from .layout import pids_of
from .parallel import replica_stats, run_replicas
from .resume import ChunkStore, ancestors, chunk_ranges, finished_by_another_job, take_back, todo_chunks
from .runtime import Timer, peak_memory

logger = logging.getLogger(__name__)


@dataclass
class ShardRun:
    """What :func:`run_shard_job` hands a job's ``assemble``, once every chunk is done.

    Attributes:
        store: the job's chunk store, every chunk in it.
        ranges: ``(start, end)`` item indices of each chunk (:func:`eagle3_pipeline.resume.chunk_ranges`).
        todo: the chunks this run did; the others were kept from an earlier, killed run.
        worker_job: the job dict the replicas were given (the stage's, with ``ranges``, ``todo``
            and what ``prepare`` added).
        stats: the replicas' timings combined (:func:`eagle3_pipeline.parallel.replica_stats`;
            empty when no replica ran).
        wall_seconds: from the replicas' start to their end; 0.0 when no chunk was left to do.
        followed: what the job's ``follow`` yielded while the replicas ran (None without one).
    """

    store: ChunkStore
    ranges: list[tuple[int, int]]
    todo: list[int]
    worker_job: dict
    stats: dict
    wall_seconds: float
    followed: Any = None


@dataclass
class ShardJob:
    """One resumable per-shard job, as :func:`run_shard_job` runs it.

    Attributes:
        outputs: the job's outputs but its record; the first is the main one, beside which the
            chunk store lives (``.<name>.partial/``) and from which the run's process records
            folder is found (:func:`eagle3_pipeline.layout.pids_of`). A shard counts as finished by
            another job when all of them and the record exist.
        record: the JSON the job writes last (a summary or an index); it names ``fingerprint``.
        fingerprint: identity (hex digest) of the job's inputs and of the settings that change
            its result; chunks and records of another fingerprint are not this job's.
        chunk_suffix: the suffix of the chunk files (``.jsonl``; ``.done`` for done markers).
        num_items: records (prompts, samples) of the shard, split in chunks in their order.
        chunk_size: items per chunk (part of ``fingerprint``: it defines the chunks).
        chunk_key: the config key that sets ``chunk_size``, named when the chunks are too few to
            keep every replica busy (:func:`balance_warning`).
        worker: ``worker(worker_job, rank, chunks)``, one replica: does the chunks it takes from
            the iterator ``chunks``, writes each into the store (:meth:`ChunkStore.writing`) and
            its timings to ``replica-<rank>.json`` there. A module-level function: replicas of a
            data-parallel job are spawned processes.
        worker_job: the worker's job dict (picklable); the runner adds ``ranges`` and ``todo``.
        assemble: ``assemble(ShardRun) -> dict``: writes the outputs from the finished chunks and
            returns the record's stage-specific fields; the runner adds the chunk counts, the
            replicas' layout and timings, peak memory and ``fingerprint``, and writes the record.
        unassemble: ``unassemble(ShardRun)``, when the record cannot be written after
            ``assemble`` (a full disk): puts what ``assemble`` moved out of the chunk store back,
            so that the rerun resumes every finished chunk rather than losing them with the
            outputs Snakemake deletes after a failed job.
        prepare: ``prepare(store) -> dict`` once the store is open, before chunks are counted (it
            may drop chunks that no longer apply); its result is added to ``worker_job``.
        follow: ``follow(store, worker_job)`` -> a context manager entered while the replicas run
            and until the output is assembled (extraction hashes its shard as chunks finish,
            :class:`eagle3_pipeline.shards.ShardHasher`); what it yields is :attr:`ShardRun.followed`.
        replicas: data-parallel replicas (D).
        gpus_per_replica: GPUs of one replica (tensor × pipeline parallel size).
        replicas_per_gpu: replicas that share one GPU.
        keep_finished: when this job's snakemake ends while it runs, keep its finished outputs and
            record (hard links) for the rerun, which takes them back; the record must then name the
            main output's bytes under ``record_hash_keys`` (checked before they are taken back).
            False keeps the chunks alone, which the rerun assembles again without an engine.
        record_hash_keys: the record's keys of the main output's SHA-256 and stat
            (:func:`eagle3_pipeline.io.recorded_sha256`).
    """

    outputs: Sequence[str]
    record: str
    fingerprint: str
    chunk_suffix: str
    num_items: int
    chunk_size: int
    worker: Callable[[dict, int, Iterator[int]], None]
    worker_job: dict
    assemble: Callable[[ShardRun], dict]
    unassemble: Callable[[ShardRun], None] | None = None
    prepare: Callable[[ChunkStore], dict] | None = None
    follow: Callable[[ChunkStore, dict], AbstractContextManager] | None = None
    replicas: int = 1
    gpus_per_replica: int = 1
    replicas_per_gpu: int = 1
    keep_finished: bool = False
    chunk_key: str = "the chunk size"
    record_hash_keys: tuple[str, str] = ("sha256", "stat")

    def check_outputs(self) -> str:
        """The main output's SHA-256, checked against what the record names under
        ``record_hash_keys`` (:func:`eagle3_pipeline.io.recorded_sha256`).

        Raises:
            InputError: its bytes differ from the record's.
        """
        return recorded_sha256(self.outputs[0], self.record, *self.record_hash_keys)

    def open_store(self) -> ChunkStore:
        """The job's chunk store (:class:`eagle3_pipeline.resume.ChunkStore`): opening it discards
        chunks of another fingerprint and temporary files of a killed writer."""
        return ChunkStore(self.outputs[0], self.fingerprint, self.chunk_suffix)


def run_shard_job(job: ShardJob, *, host_lock_enabled: bool = True) -> dict:
    """Run one resumable per-shard job: do the chunks still to do, assemble, write the record.

    A killed job's rerun does only the chunks it had not finished, and the output equals an
    uninterrupted run's (the stage assembles in chunk order). Replicas run only when chunks
    remain; with none left (every chunk kept) the output is assembled without an engine.

    Args:
        job: what the stage's chunks are and how its output is assembled (:class:`ShardJob`).
        host_lock_enabled: hold the host-wide full-model lock while counting chunks and running
            the replicas (off on a cluster, where each job owns its GPUs).

    Returns:
        the record written to ``job.record``; or the record of the output another job of this
        shard finished (while this one waited for the lock, or after its snakemake ended), which
        is kept and not made again.

    Raises:
        RuntimeError: a replica failed, or a chunk is not done after the replicas ended (finished
            chunks are kept: a rerun resumes); or other GPU processes hold the GPUs
            (:func:`eagle3_pipeline.hygiene.check_gpus_free`).
        ValueError: fewer GPUs visible than the replicas need (:func:`eagle3_pipeline.parallel.run_replicas`).
        Whatever ``job.prepare`` or ``job.assemble`` raise (e.g. ``InputError``: nothing usable).
    """
    main = job.outputs[0]
    parents = ancestors()  # this job's snakemake (and any shell between): ChunkStore.finish
    with host_lock(enabled=host_lock_enabled):
        # Chunks are counted only once the lock is ours: the job of an earlier snakemake that
        # was killed alone lives on, holds the lock, and may finish this shard and remove its
        # chunks while this job waits.
        done = finished_by_another_job(job.record, job.outputs, job.fingerprint)
        if done is not None:
            job.open_store().remove()  # what that job kept for a rerun (chunks, or links to its outputs)
            return done
        # engines of a killed earlier job may still be writing into the store (extraction's
        # engines write states into the partial shard): end them before it is opened and its done
        # chunks are counted (and before the GPU check below)
        cleanup_stale_processes(pids_of(main))
        store = job.open_store()
        if job.keep_finished:
            kept = _take_back(job, store)
            if kept is not None:
                return kept
            store = job.open_store()  # removed when what was kept was altered
        for old in store.dir.glob("replica-*.json"):  # timings of an earlier run's replicas
            old.unlink()
        worker_job = {**job.worker_job, **(job.prepare(store) if job.prepare is not None else {})}
        ranges = chunk_ranges(job.num_items, job.chunk_size)
        todo = todo_chunks(store, ranges)
        worker_job |= {"ranges": ranges, "todo": todo}
        warning = balance_warning(ranges, todo, job.replicas, job.chunk_key)
        if warning:
            logger.warning("%s: %s", main, warning)
        with job.follow(store, worker_job) if job.follow is not None else contextlib.nullcontext() as followed:
            wall = Timer()
            if todo:
                check_gpus_free()
                run_replicas(functools.partial(job.worker, worker_job), todo, job.replicas, job.gpus_per_replica, job.replicas_per_gpu)
            wall_s = wall.seconds if todo else 0.0
            missing = sorted(set(range(len(ranges))) - set(store.finished()))
            if missing:
                raise RuntimeError(f"{main}: chunk(s) {missing[:5]} were not done; rerun the job to resume")
            stats = replica_stats(store.dir)
            run = ShardRun(store, ranges, todo, worker_job, stats, wall_s, followed)
            record = job.assemble(run)
        record |= {
            "chunks": len(ranges),
            "chunks_resumed": len(ranges) - len(todo),
            "data_parallel_size": job.replicas,
            "replicas_per_gpu": job.replicas_per_gpu,
            "model_load_seconds": round(stats.get("model_load_seconds", 0.0), 3),
            "replicas": stats.get("replicas", []),
        }
        record |= peak_memory() | {"fingerprint": job.fingerprint}
        try:
            write_json_atomic(job.record, record)
        except BaseException:
            if job.unassemble is not None:
                job.unassemble(run)
                logger.error("%s: its record %s could not be written; its finished chunks are kept for the rerun", main, job.record)
            raise
        # when snakemake ended meanwhile: the finished outputs kept for its rerun, or (keep_finished
        # False) every chunk, which the rerun assembles again without an engine
        store.finish([*job.outputs, job.record] if job.keep_finished else [], parents)
    return record


def keep_for_rerun(outputs: Sequence[str], record: str, check: Callable[[], object]) -> bool:
    """Keep a finished shard job's outputs for the rerun that Snakemake is about to start of it.

    Snakemake marks a job's outputs incomplete when the job starts and clears the mark when it
    has seen the job end. A snakemake killed in between (on a cluster: before its status poll saw
    the job finish) leaves finished outputs marked, and its rerun deletes them and runs the job
    again. Called (by the ``onstart`` hook, :func:`eagle3_pipeline.snakemake_adapter.keep_incomplete_finished_shards`)
    before Snakemake deletes anything, this hard-links ``outputs`` and ``record`` into the job's
    chunk store under the fingerprint the record names, as :meth:`ChunkStore.finish` does for a job
    that outlived its snakemake; the job then takes them back when its own fingerprint is the
    same (:func:`run_shard_job` with ``keep_finished``), and does the work again when not.

    Args:
        outputs: the job's outputs but its record, the main one first (:attr:`ShardJob.outputs`).
        record: the record the job writes last (:attr:`ShardJob.record`).
        check: what checks the outputs' bytes against what their job recorded, raising
            :class:`InputError` where they differ: a shard's :meth:`ShardJob.check_outputs`, or
            training's drafter folder against its record of files (the training job takes them back
            with :func:`eagle3_pipeline.resume.take_back_kept`).

    Returns:
        True when they were kept; False when the record is missing or unreadable, an output is
        missing, or the main output's bytes differ from the recorded ones (logged).
    """
    try:
        rec = read_json(record)
    except (OSError, ValueError):
        return False
    if not isinstance(rec, dict) or not rec.get("fingerprint") or not all(Path(p).exists() for p in outputs):
        return False
    try:
        check()
    except InputError as e:
        logger.warning("not keeping %s for its rerun: %s", outputs[0], e)
        return False
    ChunkStore(outputs[0], rec["fingerprint"], ".kept").keep([*outputs, record])
    return True


#: Fewer chunks than this per replica leave replicas idle while the last chunks finish.
MIN_CHUNKS_PER_REPLICA = 2


def balance_warning(ranges: Sequence[tuple[int, int]], todo: Sequence[int], replicas: int, chunk_key: str) -> str | None:
    """Why the chunks to do cannot keep ``replicas`` replicas busy, or None when they can.

    Replicas take chunks from one queue (:func:`eagle3_pipeline.parallel.run_replicas`), so
    each ends within about one chunk of the others; with fewer than
    :data:`MIN_CHUNKS_PER_REPLICA` chunks each, that chunk is a large part of the job (measured
    on an H200: 3,000 prompts in chunks of 2,048 gave one replica 2.57M tokens and the other
    1.18M, which then waited 71 of the job's 125 s).

    Args:
        ranges: ``(start, end)`` item indices of every chunk.
        todo: indices of the chunks still to do.
        replicas: data-parallel replicas (D).
        chunk_key: the config key that sets the chunk size, named in the advice.

    Returns:
        one sentence: the chunks to do, the largest share of items one replica can get against an
        even share, and the key to lower; None with one replica, nothing to do, or enough chunks.
    """
    if replicas <= 1 or not todo or len(todo) >= MIN_CHUNKS_PER_REPLICA * replicas:
        return None
    sizes = sorted((ranges[i][1] - ranges[i][0] for i in todo), reverse=True)
    items = sum(sizes)
    # the queue hands the chunks out in order; one replica may get every ceil(n / D)-th largest
    worst = sum(sizes[: -(-len(sizes) // replicas)])
    return (
        f"{len(todo)} chunk(s) of up to {sizes[0]} items for {replicas} replicas: one replica may do {worst} of {items} items "
        f"while an even share is {-(-items // replicas)}; set {chunk_key} to at most "
        f"{max(1, items // (MIN_CHUNKS_PER_REPLICA * replicas))} to keep every replica busy"
    )


def _take_back(job: ShardJob, store: ChunkStore) -> dict | None:
    """The record of the outputs this shard's job finished after its snakemake ended, put back in
    place when the main output's bytes are the ones it recorded (:func:`eagle3_pipeline.resume.take_back`);
    None when there are none, or they were altered (then they and the store are removed)."""
    return take_back(store, job.outputs, job.record, job.check_outputs)
