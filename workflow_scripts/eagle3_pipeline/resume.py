"""Resumable shard jobs: finished chunks survive a killed job; the rerun does only the rest.

A shard job (generation or extraction of one shard) splits its records, in their fixed
(prompt-id) order, into chunks of a fixed size. Each finished chunk is written
atomically into ``.<output name>.partial/`` beside the final output, so a chunk file
exists only when complete. A rerun with the same inputs and settings (same
*fingerprint*) skips the chunks already there; with a different fingerprint the old
chunks are discarded. When every chunk is done the job assembles the final output in
chunk order (deterministic, whatever order chunks finished in) and removes the
directory. Snakemake deletes a failed job's outputs but not this directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path

from .io import atomic_path, write_text_atomic
from .layout import CHECKPOINT_DIR

logger = logging.getLogger(__name__)


class ChunkStore:
    """Finished chunks of one shard job, kept across kills.

    Args:
        final_path: the job's final output; chunks live in ``.<name>.partial/`` beside it.
        fingerprint: identity of the job's inputs and settings (hex digest); chunks
            written under another fingerprint are discarded.
        suffix: chunk file suffix (``.jsonl``, ``.safetensors``).
    """

    def __init__(self, final_path: str | os.PathLike, fingerprint: str, suffix: str):
        self.final_path = Path(final_path)
        self.dir = self.dir_for(final_path)
        self.suffix = suffix
        stamp = self.dir / "FINGERPRINT"
        if self.dir.exists():
            old = stamp.read_text().strip() if stamp.is_file() else None
            if old != fingerprint:
                n = len(self.finished())
                logger.warning("%s: inputs or settings changed since %d chunk(s) were written; discarding them", self.final_path, n)
                shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(".*.tmp"):  # temp files of a job killed mid-write
            stale.unlink(missing_ok=True)
        if not stamp.is_file():
            write_text_atomic(stamp, fingerprint + "\n")
        self._written = 0

    @classmethod
    def attach(cls, final_path: str | os.PathLike, suffix: str) -> ChunkStore:
        """The store a job already opened, for its data-parallel replica processes.

        Unlike the constructor it neither checks the fingerprint nor removes temporary
        files (another replica may be writing one).
        """
        self = cls.__new__(cls)
        self.final_path = Path(final_path)
        self.dir = cls.dir_for(final_path)
        self.suffix = suffix
        self._written = 0
        return self

    @staticmethod
    def dir_for(final_path: str | os.PathLike) -> Path:
        """The folder of the chunks of ``final_path``: ``.<name>.partial`` beside it."""
        final = Path(final_path)
        return final.parent / f".{final.name}.partial"

    def path(self, index: int) -> Path:
        """Path of chunk ``index`` (exists only once the chunk is complete)."""
        return self.dir / f"chunk-{index:06d}{self.suffix}"

    def finished(self) -> list[int]:
        """Indices of the complete chunks."""
        return sorted(int(p.name[6:12]) for p in self.dir.glob(f"chunk-*{self.suffix}")) if self.dir.exists() else []

    @contextlib.contextmanager
    def writing(self, index: int) -> Iterator[Path]:
        """Yield a temporary path that becomes chunk ``index`` when the block succeeds.

        Fault injection for tests: with ``EAGLE3_FAULT_KILL_AFTER_CHUNKS=K`` the process
        SIGKILLs itself right after its K-th chunk is in place; with
        ``EAGLE3_FAULT_KILL_MID_CHUNK=K`` it does so while its K-th chunk is written
        but not yet renamed into place.
        """
        self._written += 1
        with atomic_path(self.path(index), suffix=self.suffix) as tmp:
            yield tmp
            if _fault("EAGLE3_FAULT_KILL_MID_CHUNK") == self._written:
                os.kill(os.getpid(), signal.SIGKILL)
        if _fault("EAGLE3_FAULT_KILL_AFTER_CHUNKS") == self._written:
            os.kill(os.getpid(), signal.SIGKILL)

    def remove(self) -> None:
        """Delete the chunk directory (after the final output is written)."""
        shutil.rmtree(self.dir, ignore_errors=True)

    def finish(self, outputs: Sequence[str | os.PathLike], parents: Sequence[tuple[int, float]]) -> None:
        """End the job: delete the store, or, when the snakemake that started the job has ended
        (:func:`orphaned`), keep it, with hard links to the finished ``outputs`` (none: the
        chunks alone, which a rerun assembles again), for the rerun.

        Snakemake killed alone leaves its running job's outputs marked incomplete, and the rerun
        deletes them before its job starts; that job then takes them back (:meth:`take_finished`)
        instead of doing the work again.
        """
        if not orphaned(parents):
            self.remove()
            return
        self.keep(outputs)
        logger.warning(
            "the snakemake that started this job has ended: its rerun will delete %s as incomplete; %s kept in %s for that "
            "rerun, which does not do the work again",
            self.final_path,
            "the finished output is" if outputs else "every finished chunk is",
            self.dir,
        )

    def keep(self, outputs: Sequence[str | os.PathLike]) -> None:
        """Hard-link each of ``outputs`` into the store as ``finished-<name>`` (no copy: the same
        bytes and inode; a folder as a tree of links to its files), for a rerun's
        :meth:`take_finished`; an earlier one of that name is replaced."""
        for p in outputs:
            dest = self.dir / f"finished-{Path(p).name}"
            _link(p, dest)

    def take_finished(self, outputs: Sequence[str | os.PathLike]) -> bool:
        """Put back the outputs a job of this store finished after its snakemake ended (:meth:`finish`).

        The store's fingerprint was checked when it was opened, so they are this job's result.

        Returns:
            True when every output was kept and is in place again (hard links: same bytes, inode
            and mtime as their job wrote, unless altered since: the caller checks and says which);
            False when this job has to do the work.
        """
        kept = [self.dir / f"finished-{Path(p).name}" for p in outputs]
        if not all(k.exists() for k in kept):
            return False
        for k, p in zip(kept, outputs, strict=True):
            _link(k, p)
        return True


def _link(src: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Make ``dest`` a hard link of the file ``src``, or of a folder a tree of hard links to its
    files, replacing what ``dest`` held."""
    dest = Path(dest)
    if dest.is_dir() and not dest.is_symlink():
        shutil.rmtree(dest)
    else:
        dest.unlink(missing_ok=True)
    if Path(src).is_dir():
        shutil.copytree(src, dest, copy_function=os.link)
    else:
        os.link(src, dest)


def take_back(store: ChunkStore, outputs: Sequence[str | os.PathLike], record: str | os.PathLike, check) -> dict | None:
    """The record of the outputs a job finished after its snakemake ended (or was killed before it
    saw the job end), put back in place from ``store`` (:meth:`ChunkStore.take_finished`).

    Args:
        store: the job's store, opened under its fingerprint.
        outputs: the job's outputs but its record (files or folders), the main one first.
        record: the record the job writes last.
        check: called once they are back; raises :class:`eagle3_pipeline.io.InputError` when their
            bytes are not the ones their job recorded: then they and the store are removed, and the
            job does its work again.

    Returns:
        the record (the store removed), or None when nothing was kept (the store left as it is,
        e.g. with a shard job's finished chunks) or the kept outputs were altered.
    """
    from .io import InputError, read_json

    finished = [*outputs, record]
    if not store.take_finished(finished):
        return None
    try:
        check()
    except InputError as e:
        logger.warning("not taking back the kept outputs: %s; doing this job's work again", e)
        for p in map(Path, finished):
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
        store.remove()
        return None
    logger.info("%s: finished by this job after its snakemake ended; taken back from %s", outputs[0], store.dir)
    store.remove()
    return read_json(record)


def take_back_kept(outputs: Sequence[str | os.PathLike], record: str | os.PathLike, fingerprint: str, check) -> dict | None:
    """:func:`take_back` for a job without a chunk store of its own (training): from the store the
    rerun's ``onstart`` hook kept its outputs in (:func:`eagle3_pipeline.shard_job.keep_for_rerun`)
    before Snakemake deleted them as incomplete. A store kept under another ``fingerprint``
    (changed inputs or settings) is discarded; the store is removed either way.

    Returns:
        the record, or None when this job has to do the work.
    """
    if not ChunkStore.dir_for(outputs[0]).is_dir():
        return None
    store = ChunkStore(outputs[0], fingerprint, ".kept")
    try:
        return take_back(store, outputs, record, check)
    finally:
        store.remove()


def ancestors() -> list[tuple[int, float]]:
    """``(pid, create time)`` of this process's parent, its parent, ... up to the nearest snakemake
    process (psutil): recorded when a job starts, for :func:`orphaned`.

    The chain stops at snakemake: the processes above it (``make``, the shell that started a
    ``nohup snakemake ... &`` and was closed, a terminal multiplexer) may end while the run goes on.
    Without a snakemake among them (a job's function called directly) it goes up to, not
    including, process 1.
    """
    import psutil

    chain = []
    for p in psutil.Process().parents():
        if p.pid <= 1:
            break
        chain.append((p.pid, p.create_time()))
        if _is_snakemake(p):
            break
    return chain


def _is_snakemake(process) -> bool:
    """Whether a psutil process runs snakemake (``snakemake ...``, ``python .../snakemake ...``,
    ``python -m snakemake ...``)."""
    import psutil

    try:
        args = process.cmdline()[:3]
    except (psutil.Error, OSError):
        return False
    return any(Path(a).name == "snakemake" for a in args)


def orphaned(parents: Sequence[tuple[int, float]]) -> bool:
    """True when a process of ``parents`` (:func:`ancestors` at the job's start) has ended: the
    snakemake that runs the job, or a shell between them, was killed."""
    from .hygiene import same_process

    return not all(same_process(pid, start) for pid, start in parents)


def _fault(var: str) -> int | None:
    v = os.environ.get(var)
    return int(v) if v else None


def finished_by_another_job(record_path: str | os.PathLike, outputs: Sequence[str | os.PathLike], fingerprint: str) -> dict | None:
    """The record (summary or index JSON) of a shard another process finished while this job waited.

    Snakemake deletes a job's outputs before the job starts, so outputs present once the job
    holds the host-wide lock were written since, by a job of the same shard that outlived its
    snakemake (killed alone). They are this job's result when ``record_path`` names the same
    ``fingerprint`` (inputs and settings) and every path of ``outputs`` exists.

    Returns:
        the record, or None when this job has to do the work.
    """
    rec = Path(record_path)
    if not rec.is_file() or not all(Path(p).exists() for p in outputs):
        return None
    try:
        record = json.loads(rec.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("fingerprint") != fingerprint:
        return None
    logger.info("%s: finished by another job of these outputs while this one waited for its lock; keeping its output", rec)
    return record


def chunk_ranges(n: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` covering ``range(n)`` in chunks of ``chunk_size`` (last may be shorter)."""
    return [(s, min(s + chunk_size, n)) for s in range(0, n, chunk_size)]


def todo_chunks(store: ChunkStore, ranges: Sequence[tuple[int, int]]) -> list[int]:
    """Indices of the chunks still to do, logging what a resume skips."""
    done = set(store.finished())
    todo = [i for i in range(len(ranges)) if i not in done]
    if done:
        logger.info(
            "resuming %s: %d of %d chunks already finished (%d records), %d to do",
            store.final_path,
            len(done & set(range(len(ranges)))),
            len(ranges),
            sum(ranges[i][1] - ranges[i][0] for i in done if i < len(ranges)),
            len(todo),
        )
    return todo


def kept_work(run_dir: str | os.PathLike) -> list[str]:
    """What an interrupted run under ``run_dir`` (``results/<run>``) keeps for its rerun, one line each.

    Lists every chunk store (``.<output>.partial/``, :class:`ChunkStore`) with finished chunks,
    with their count, and every training checkpoint (``.checkpoint/progress.json``, written by
    :class:`eagle3_pipeline.training.TrainCheckpoint`) with its step. A store or checkpoint
    written under other inputs or settings is still listed: the rerun decides (and logs)
    whether it applies. Unreadable entries are named as such, never raised.
    """
    root = Path(run_dir)
    lines = []
    for d in sorted(root.rglob(".*.partial")):
        if not d.is_dir():
            continue
        final = d.parent / d.name[1 : -len(".partial")]
        n = sum(bool(re.fullmatch(r"chunk-\d{6}\.[a-z]+", p.name)) for p in d.iterdir())  # not specs, temp files
        if n:  # a store whose first chunk had not finished keeps nothing a rerun uses
            lines.append(f"{n} finished chunk(s) of {final}")
    for meta in sorted(root.rglob(f"{CHECKPOINT_DIR}/progress.json")):
        ck = checkpoint_progress(meta.parent)
        if ck is None:
            lines.append(f"training checkpoint in {meta.parent} (progress.json unreadable)")
        else:
            lines.append(
                f"training checkpoint at step {ck[0]}/{ck[1]} in {meta.parent} (used if the training's inputs and settings are unchanged)"
            )
    return lines


def checkpoint_progress(checkpoint_dir: str | os.PathLike) -> tuple[int, int] | None:
    """``(step, total_steps)`` from a training checkpoint's ``progress.json``
    (:class:`eagle3_pipeline.training.TrainCheckpoint`), or None when missing or unreadable."""
    try:
        m = json.loads((Path(checkpoint_dir) / "progress.json").read_text(encoding="utf-8"))
        step, total = int(m["step"]), int(m["total_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (step, total) if 0 <= step <= total and total > 0 else None
