"""extract_hidden_states: the resumable job that fills one trace shard's hidden-state shard.

It reads the traces, checks disk and GPUs, and dispatches the chunks to a backend: ``hf``
(:mod:`eagle3_pipeline.hf_backend`) or ``vllm`` (:mod:`eagle3_pipeline.vllm_extraction`).
The shard format is :mod:`eagle3_pipeline.shards`.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from .runtime import rate
from .shards import (
    DONE_SUFFIX,
    FP8,
    INDEX_HASH_KEYS,
    STORAGE_DTYPES,
    ShardHasher,
    allocated_bytes,
    partial_shard_path,
    prepare_partial_shard,
    sample_from_trace,
    shard_index,
)

logger = logging.getLogger(__name__)


def extraction_fingerprint(traces_path: str, target: str, cfg: dict, max_seq_len: int) -> str:
    """Identity (hex SHA-256) of what an extraction job's chunks contain.

    Covers the traces' bytes (checked against generation's record: an altered trace shard is an
    :class:`~eagle3_pipeline.io.InputError`), the target's fingerprint, the settings that change
    what the job writes (:func:`eagle3_pipeline.config.extraction_result_settings`, the rule's
    params: backend, layer ids, storage dtype, the hf backend's batch size, whose padded batches
    round differently, the vllm backend's engine), the chunk size and ``max_seq_len``: a resume
    keeps chunks only when all match, so a shard never mixes backends or batchings. Replica
    counts and the disk check are left out (they do not change which states are written).
    """
    from .config import extraction_result_settings
    from .generation import recorded_traces_sha256
    from .io import sha256_json
    from .target_model import model_fingerprint

    params = extraction_result_settings(cfg) | {"chunk_samples": cfg["chunk_samples"], "max_seq_len": max_seq_len}
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
    is done, equals an uninterrupted run's. Its SHA-256, recorded in the index, is taken while
    the replicas fill it (:class:`eagle3_pipeline.shards.ShardHasher`), not by reading the
    shard back after the last chunk (``hash_tail_seconds``: what was left to hash then). The job's lifecycle (host-wide lock, a shard another
    job finished, stale engines, replicas) is :func:`eagle3_pipeline.shard_job.run_shard_job`'s. With
    ``cfg["data_parallel_size"] = D > 1``, D model replicas, each on
    ``cfg["gpus_per_replica"]`` GPUs, share the chunks (:mod:`eagle3_pipeline.parallel`);
    vLLM engines can share GPUs (``cfg["replicas_per_gpu"]``, the ``vllm:`` section's).
    Before loading the model, a disk preflight compares the estimated bytes (tokens ×
    layers × hidden × dtype bytes, less what a killed job's partial shard holds already) with
    the free space (``cfg["disk_preflight"]``).

    Returns:
        the shard index (also written to ``out_index``), plus timing fields.

    Raises:
        InputError: not enough disk space; ValueError: a trace exceeds ``max_seq_len``
            or has an empty completion, or fewer GPUs are visible than the replicas need;
            FloatingPointError: NaN/Inf states; RuntimeError: a replica failed (finished chunks are kept).
    """
    from .conventions import resolve_layer_ids
    from .hygiene import check_disk, hidden_state_bytes
    from .io import read_jsonl
    from .resume import ChunkStore
    from .shard_job import ShardJob, ShardRun, run_shard_job
    from .target_model import text_config

    tcfg = text_config(target, trust_remote_code)
    aux, layer_ids = resolve_layer_ids(cfg["aux_layer_ids"], tcfg.num_hidden_layers)
    samples = [sample_from_trace(t, max_seq_len) for t in read_jsonl(traces_path)]
    dtype = STORAGE_DTYPES[cfg["storage_dtype"]]
    if cfg["disk_preflight"]:
        tokens = sum(len(s.input_ids) for s in samples)
        need = hidden_state_bytes(tokens, len(layer_ids), tcfg.hidden_size, dtype.itemsize)
        need += tokens * len(layer_ids) * 4 if dtype == FP8 else 0  # per-row scales
        # a killed job's partial shard (preallocated) holds its space already: reused or replaced
        need -= allocated_bytes(partial_shard_path(ChunkStore.dir_for(out_shard)))
        check_disk(out_shard, max(need, 0), what=f"extraction of {traces_path}", override_key="extraction.disk_preflight")
    layout = {"layer_ids": layer_ids, "aux_layer_ids": aux, "hidden_size": tcfg.hidden_size, "storage_dtype": dtype}

    def prepare(store) -> dict:
        """The shard preallocated in the chunk store, filled in place by the replicas (its done
        chunks kept only when it matches these samples and layout)."""
        return {"shard_file": str(prepare_partial_shard(store, samples, **layout))}

    def follow(store, worker_job: dict):
        """The partial shard hashed while the replicas fill it (:class:`eagle3_pipeline.shards.ShardHasher`)."""
        rows = worker_job["rows"]
        hasher = ShardHasher(worker_job["shard_file"], [(rows[a], rows[b]) for a, b in worker_job["ranges"]])
        return hasher.following(store.finished)

    def assemble(run: ShardRun) -> dict:
        """The partial shard renamed into place, and its index (with the SHA-256 taken while it was filled)."""
        sha256 = run.followed.hexdigest()
        os.replace(run.worker_job["shard_file"], out_shard)
        index = shard_index(out_shard, samples, layer_ids=layer_ids, aux_layer_ids=aux, index_path=None, sha256=sha256)
        run_s = run.stats.get("extract_seconds", 0.0)
        return index | {
            "backend": cfg["backend"],
            "extract_seconds": round(run_s, 3),
            "tokens_per_second": rate(run.stats.get("tokens", 0), run_s),
            # hashing what was still unhashed once the last chunk was done
            "hash_tail_seconds": round(run.followed.tail_seconds, 3),
        }

    def unassemble(run: ShardRun) -> None:
        """The shard back into the chunk store, where its done chunks make it again."""
        os.replace(out_shard, run.worker_job["shard_file"])

    if cfg["backend"] == "vllm":
        from .vllm_extraction import vllm_extraction_replica as worker
    else:
        from .hf_backend import extraction_replica as worker
    return run_shard_job(
        ShardJob(
            outputs=[out_shard],
            record=out_index,
            fingerprint=extraction_fingerprint(traces_path, target, cfg, max_seq_len),
            chunk_suffix=DONE_SUFFIX,
            num_items=len(samples),
            chunk_size=cfg["chunk_samples"],
            chunk_key="extraction.chunk_samples",
            worker=worker,
            worker_job={
                "cfg": cfg,
                "samples": samples,
                "out_shard": out_shard,
                "rows": np.concatenate([[0], np.cumsum([len(x.input_ids) for x in samples])]).tolist(),
                "target": target,
                "trust_remote_code": trust_remote_code,
                "layer_ids": layer_ids,
                "aux": aux,
                "engine": cfg.get("engine"),
                "max_seq_len": max_seq_len,
            },
            assemble=assemble,
            unassemble=unassemble,
            prepare=prepare,
            follow=follow,
            replicas=cfg.get("data_parallel_size") or 1,
            gpus_per_replica=cfg.get("gpus_per_replica") or 1,
            replicas_per_gpu=(cfg.get("replicas_per_gpu") or 1) if cfg["backend"] == "vllm" else 1,  # hf replicas own their GPUs
            # the shard is filled in place and renamed: a rerun after this job's snakemake ended
            # takes the finished shard back (its chunks alone no longer make it)
            keep_finished=True,
            record_hash_keys=INDEX_HASH_KEYS,
        ),
        host_lock_enabled=host_lock_enabled,
    )
