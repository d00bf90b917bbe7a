"""extract_hidden_states: the resumable job that fills one trace shard's hidden-state shard.

It reads the traces, checks disk and GPUs, and dispatches the chunks to a backend: ``hf``
(:mod:`eagle3_pipeline.hf_backend`) or ``vllm`` (:mod:`eagle3_pipeline.vllm_extraction`).
The shard format is :mod:`eagle3_pipeline.shards`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from .io import write_json_atomic
from .layout import pids_of
from .shards import DONE_SUFFIX, FP8, STORAGE_DTYPES, prepare_partial_shard, sample_from_trace, shard_index

logger = logging.getLogger(__name__)


def extraction_fingerprint(traces_path: str, target: str, cfg: dict, max_seq_len: int) -> str:
    """Identity (hex SHA-256) of what an extraction job's chunks contain.

    Covers the traces' bytes (checked against generation's record: an altered trace shard is an
    :class:`~eagle3_pipeline.io.InputError`), the target's fingerprint, the backend, layer ids, storage
    dtype, chunk size and ``max_seq_len``: a resume keeps chunks only when all match, so a
    shard never mixes backends. Batch size, device and replica counts are left out (they
    do not change which states are written).
    """
    from .generation import recorded_traces_sha256
    from .io import sha256_json
    from .target_model import model_fingerprint

    params = {k: cfg[k] for k in ("backend", "aux_layer_ids", "storage_dtype", "chunk_samples")} | {"max_seq_len": max_seq_len}
    return sha256_json({"traces": recorded_traces_sha256(traces_path), "model": model_fingerprint(target), "params": params})


def run_extraction_shard(
    traces_path: str,
    out_shard: str,
    out_index: str,
    target: str,
    cfg: dict,
    *,
    max_seq_len: int,
    trust_remote_code: bool,
    host_lock_enabled: bool = True,
) -> dict:
    """The extract_hidden_states job: resumable, optionally data-parallel extraction of one trace shard.

    Backends (``cfg["backend"]``): ``hf`` prefills with transformers in this process
    (:func:`eagle3_pipeline.hf_backend.extract_hf`); ``vllm`` prefills with vLLM configured from ``cfg["engine"]``
    (the ``vllm:`` section) and writes each request's states from the engine
    (:mod:`eagle3_pipeline.vllm_extraction`). Both write the same format.

    The shard is preallocated in the job's chunk store (:func:`eagle3_pipeline.shards.prepare_partial_shard`)
    and filled in place (:class:`eagle3_pipeline.shards.ShardWriter`): no chunk files, no merge, the shard's
    size on disk once. Samples (prompt + completion ids of each trace, in trace order)
    are extracted in chunks of ``cfg["chunk_samples"]``; a chunk gets a done marker once
    its states are written (:mod:`eagle3_pipeline.resume`), so a killed job's rerun
    extracts only the rest, and the finished shard, renamed into place when every chunk
    is done, equals an uninterrupted run's. With
    ``cfg["data_parallel_size"] = D > 1``, D model replicas, each on
    ``cfg["gpus_per_replica"]`` GPUs, share the chunks (:mod:`eagle3_pipeline.parallel`);
    vLLM engines can share GPUs (``cfg["replicas_per_gpu"]``, the ``vllm:`` section's).
    Before loading the model, a disk preflight compares the estimated bytes (tokens ×
    layers × hidden × dtype bytes) with the free space (``cfg["disk_preflight"]``).

    Returns:
        the shard index (also written to ``out_index``), plus timing fields.

    Raises:
        InputError: not enough disk space; ValueError: a trace exceeds ``max_seq_len``
            or has an empty completion, or fewer GPUs are visible than the replicas need;
            FloatingPointError: NaN/Inf states; RuntimeError: a replica failed.
    """
    import functools

    from .conventions import resolve_layer_ids
    from .hygiene import check_disk, check_gpus_free, cleanup_stale_processes, hidden_state_bytes, host_lock
    from .io import InputError, checked_sha256, read_json, read_jsonl
    from .parallel import replica_stats, run_replicas
    from .resume import ChunkStore, ancestors, chunk_ranges, finished_by_another_job, todo_chunks
    from .runtime import peak_memory
    from .target_model import text_config

    tcfg = text_config(target, trust_remote_code)
    aux, layer_ids = resolve_layer_ids(cfg["aux_layer_ids"], tcfg.num_hidden_layers)
    samples = [sample_from_trace(t, max_seq_len) for t in read_jsonl(traces_path)]
    dtype = STORAGE_DTYPES[cfg["storage_dtype"]]
    if cfg["disk_preflight"]:
        tokens = sum(len(s.input_ids) for s in samples)
        need = hidden_state_bytes(tokens, len(layer_ids), tcfg.hidden_size, dtype.itemsize)
        need += tokens * len(layer_ids) * 4 if dtype == FP8 else 0  # per-row scales
        check_disk(out_shard, need, what=f"extraction of {traces_path}", override_key="extraction.disk_preflight")
    fingerprint = extraction_fingerprint(traces_path, target, cfg, max_seq_len)
    parents = ancestors()  # this job's snakemake (and any shell between): ChunkStore.finish
    with host_lock(enabled=host_lock_enabled):
        # Chunks are counted only once the lock is ours: the job of an earlier snakemake that
        # was killed alone lives on, holds the lock, and may finish this shard and remove its
        # chunks while this job waits.
        done = finished_by_another_job(out_index, [out_shard], fingerprint)
        if done is not None:
            ChunkStore(out_shard, fingerprint, DONE_SUFFIX).remove()  # the links that job kept for a rerun
            return done
        # engines of a killed earlier job may still be writing into the partial shard: end them
        # before counting its done chunks (and before the GPU check below)
        cleanup_stale_processes(pids_of(out_shard))
        store = ChunkStore(out_shard, fingerprint, DONE_SUFFIX)
        if store.take_finished([out_shard, out_index]):
            index = read_json(out_index)
            try:  # the bytes its job recorded (hard links: unchanged unless altered since)
                checked_sha256(out_shard, index.get("sha256"), index.get("stat"), out_index)
            except InputError as e:
                logger.warning("not taking back the kept shard: %s", e)
                for p in (out_shard, out_index):
                    Path(p).unlink(missing_ok=True)
                store.remove()
                store = ChunkStore(out_shard, fingerprint, DONE_SUFFIX)
            else:
                store.remove()
                return index
        for old in store.dir.glob("replica-*.json"):
            old.unlink()
        layout = {"layer_ids": layer_ids, "aux_layer_ids": aux, "hidden_size": tcfg.hidden_size, "storage_dtype": dtype}
        shard_file = prepare_partial_shard(store, samples, **layout)
        ranges = chunk_ranges(len(samples), cfg["chunk_samples"])
        todo = todo_chunks(store, ranges)
        replicas = cfg.get("data_parallel_size") or 1
        per_gpu = (cfg.get("replicas_per_gpu") or 1) if cfg["backend"] == "vllm" else 1  # hf replicas own their GPUs
        if todo:
            check_gpus_free()
            job = {
                "cfg": cfg,
                "samples": samples,
                "ranges": ranges,
                "todo": todo,
                "out_shard": out_shard,
                "shard_file": str(shard_file),
                "rows": np.concatenate([[0], np.cumsum([len(x.input_ids) for x in samples])]).tolist(),
                "target": target,
                "trust_remote_code": trust_remote_code,
                "layer_ids": layer_ids,
                "aux": aux,
                "engine": cfg.get("engine"),
                "max_seq_len": max_seq_len,
            }
            if cfg["backend"] == "vllm":
                from .vllm_extraction import vllm_extraction_replica as worker
            else:
                from .hf_backend import extraction_replica as worker
            run_replicas(functools.partial(worker, job), todo, replicas, cfg.get("gpus_per_replica") or 1, per_gpu)
        missing = sorted(set(range(len(ranges))) - set(store.finished()))
        if missing:
            raise RuntimeError(f"{out_shard}: chunk(s) {missing[:5]} were not extracted; rerun the job to resume")
        stats = replica_stats(store.dir)
        os.replace(shard_file, out_shard)
        index = shard_index(out_shard, samples, layer_ids=layer_ids, aux_layer_ids=aux, index_path=None)
        run_s = stats.get("extract_seconds", 0.0)
        index |= {
            "backend": cfg["backend"],
            "chunks": len(ranges),
            "chunks_resumed": len(ranges) - len(todo),
            "data_parallel_size": replicas,
            "replicas_per_gpu": per_gpu,
            "model_load_seconds": round(stats.get("model_load_seconds", 0.0), 3),
            "extract_seconds": round(run_s, 3),
            "tokens_per_second": stats.get("tokens", 0) / run_s if run_s else 0.0,
            "replicas": stats.get("replicas", []),
        }
        index |= peak_memory() | {"fingerprint": fingerprint}
        write_json_atomic(out_index, index)
        store.finish([out_shard, out_index], parents)
        return index
