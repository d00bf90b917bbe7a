"""extract_hidden_states, ``vllm`` backend: prefill through vLLM, chunk shards written in the engine.

vLLM's ``extract_hidden_states`` speculative method makes the target return the hidden
states of the requested layers and caches them per token in a KV-cache-like buffer; a
KV connector copies a finished request's rows out of that buffer (vLLM's
``ExampleHiddenStatesConnector`` writes one safetensors file per request, the path
speculators 0.9 uses). :class:`ChunkShardConnector` subclasses that connector and keeps
its extraction and asynchronous device-to-host copy, but instead of a file per request it
collects a chunk's requests in host memory (:class:`ChunkAssembler`) and writes the chunk
shard in the pipeline's format (:func:`eagle3_pipeline.hidden_states.write_shard`) from
the connector's writer threads, while the engine goes on with the next chunk. No
per-sample files; the stored values are what the target computed, in the same format and
layer order as the ``hf`` backend.

How a request is routed: its ``kv_transfer_params["hidden_states_path"]`` is
``<chunk path>::<position>``; before submitting a chunk the driver writes
``<chunk path>.spec.json`` (sample ids, input ids, loss masks, layer ids, storage dtype).
A chunk file appears (atomically) once all its requests are written; a failure writes
``<chunk path>.error`` with the reason, which the driver raises.

Layer ids: vLLM's aux hidden-state id ``k`` is the embedding output for ``k = 0`` and the
residual stream after decoder layer ``k - 1`` otherwise (``hidden_states + residual``,
before the final norm for ``k = n``), the same convention as
:mod:`eagle3_pipeline.conventions`; vLLM returns them in ascending order, and the
connector reorders them to ``layer_ids`` order.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from .io import atomic_path, write_text_atomic

logger = logging.getLogger(__name__)

#: Separator between a chunk path and a request's position in it (in ``hidden_states_path``).
ROUTE_SEP = "::"
CONNECTOR_NAME = "ChunkShardConnector"
#: Chunks per ``generate`` call: the engine drains its batch at the end of each call.
CHUNKS_PER_CALL = 4
#: Seconds to wait, after the last chunk's prefill, for the engine to finish writing chunks.
WRITE_TIMEOUT_S = 600.0


def route(chunk_path: str | os.PathLike, position: int) -> str:
    """The ``hidden_states_path`` value that routes a request to slot ``position`` of a chunk."""
    return f"{chunk_path}{ROUTE_SEP}{position}"


def parse_route(value: str) -> tuple[str, int]:
    """Inverse of :func:`route`: ``(chunk path, position)``.

    Raises:
        ValueError: ``value`` was not made by :func:`route`.
    """
    path, sep, pos = value.rpartition(ROUTE_SEP)
    if not sep or not pos.isdigit():
        raise ValueError(f"hidden_states_path {value!r} is not '<chunk path>{ROUTE_SEP}<position>'")
    return path, int(pos)


def spec_path(chunk_path: str | os.PathLike) -> Path:
    return Path(f"{chunk_path}.spec.json")


def error_path(chunk_path: str | os.PathLike) -> Path:
    return Path(f"{chunk_path}.error")


def write_chunk_spec(chunk_path, samples, *, layer_ids: Sequence[int], aux_layer_ids: Sequence[int], storage_dtype: str) -> None:
    """Write what the connector needs to assemble a chunk (``<chunk>.spec.json``, atomically).

    Args:
        samples: :class:`eagle3_pipeline.hidden_states.Sample` list, in chunk order.
        layer_ids: captured ids in stored order (``aux_layer_ids + [n]``).
        storage_dtype: a key of :data:`eagle3_pipeline.hidden_states.STORAGE_DTYPES`.
    """
    spec = {
        "sample_ids": [s.id for s in samples],
        "input_ids": [s.input_ids.tolist() for s in samples],
        "loss_mask": ["".join("1" if m else "0" for m in s.loss_mask) for s in samples],
        "layer_ids": list(layer_ids),
        "aux_layer_ids": list(aux_layer_ids),
        "storage_dtype": storage_dtype,
    }
    error_path(chunk_path).unlink(missing_ok=True)
    write_text_atomic(spec_path(chunk_path), json.dumps(spec))


def engine_layer_ids(layer_ids: Sequence[int]) -> list[int]:
    """The ids to request from vLLM: ``layer_ids`` sorted and de-duplicated (vLLM's output order)."""
    return sorted(set(layer_ids))


class ChunkAssembler:
    """Collects the per-request states of chunks and writes each chunk shard when complete.

    Thread-safe: :meth:`add` is called from the connector's writer threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[dict, dict[int, torch.Tensor]]] = {}

    def add(self, chunk_path: str, position: int, hidden_states: torch.Tensor, token_ids: torch.Tensor) -> bool:
        """Add one request's states; write the chunk when it was the last one.

        The request's states are checked and reordered to ``layer_ids`` order at once, into
        a new (pageable) tensor, so the engine's pinned copy buffer is released right away.

        Args:
            hidden_states: ``[T, L', H]`` as vLLM returns them (``L'`` = the
                :func:`engine_layer_ids`), any dtype, on CPU.
            token_ids: int ``[T]``, the request's prompt ids.

        Returns:
            True when this call wrote the chunk file.

        Raises:
            ValueError: the token ids differ from the spec's sample, or the position is
                out of range; FloatingPointError: NaN/Inf states. Either is also written
                to ``<chunk>.error`` for the driver.
        """
        try:
            with self._lock:
                if chunk_path not in self._pending:
                    self._pending[chunk_path] = (json.loads(spec_path(chunk_path).read_text()), {})
                spec, parts = self._pending[chunk_path]
            if not 0 <= position < len(spec["sample_ids"]):
                raise ValueError(f"{chunk_path}: position {position} outside the chunk's {len(spec['sample_ids'])} samples")
            states = self._check(chunk_path, spec, position, hidden_states, token_ids)
            with self._lock:
                parts[position] = states
                if len(parts) < len(spec["sample_ids"]):
                    return False
                del self._pending[chunk_path]
            self._write(chunk_path, spec, parts)
            return True
        except Exception as e:
            with self._lock:
                self._pending.pop(chunk_path, None)
            error_path(chunk_path).write_text(f"{type(e).__name__}: {e}\n")
            raise

    @staticmethod
    def _check(chunk_path: str, spec: dict, i: int, hs: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        """Sample ``i``'s states in ``layer_ids`` order, after checking ids, shape and finiteness."""
        sid = spec["sample_ids"][i]
        engine_ids = engine_layer_ids(spec["layer_ids"])
        ids = spec["input_ids"][i]
        if tok.shape[0] != len(ids) or tok.tolist() != ids:
            raise ValueError(
                f"{chunk_path}: sample {sid}: the engine prefilled other token ids than the trace's ({tok.shape[0]} vs {len(ids)} tokens)"
            )
        if hs.shape[0] != len(ids) or hs.shape[1] != len(engine_ids):
            raise ValueError(f"{chunk_path}: sample {sid}: states of shape {tuple(hs.shape)}, expected [{len(ids)}, {len(engine_ids)}, H]")
        out = hs.index_select(1, torch.tensor([engine_ids.index(k) for k in spec["layer_ids"]]))
        if not torch.isfinite(out).all():
            raise FloatingPointError(f"sample {sid}: hidden states contain NaN/Inf")
        return out

    @staticmethod
    def _write(chunk_path: str, spec: dict, parts: dict[int, torch.Tensor]) -> None:
        from .hidden_states import STORAGE_DTYPES, Sample, write_shard

        samples = [
            Sample(
                sid,
                np.asarray(spec["input_ids"][i], dtype=np.int64),
                np.frombuffer(spec["loss_mask"][i].encode(), dtype=np.uint8) == ord("1"),
            )
            for i, sid in enumerate(spec["sample_ids"])
        ]
        t = time.perf_counter()
        with atomic_path(chunk_path, suffix=".safetensors") as tmp:
            write_shard(
                tmp,
                samples,
                [parts[i] for i in range(len(samples))],
                layer_ids=spec["layer_ids"],
                aux_layer_ids=spec["aux_layer_ids"],
                index_path=None,
                storage_dtype=STORAGE_DTYPES[spec["storage_dtype"]],
                checksum=False,
            )
        spec_path(chunk_path).unlink(missing_ok=True)
        s = time.perf_counter() - t
        size = os.path.getsize(chunk_path)
        logger.info(
            "wrote %s: %d samples, %.0f MB in %.2f s (%.0f MB/s)", chunk_path, len(samples), size / 1e6, s, size / 1e6 / max(s, 1e-9)
        )


class _Done:
    """Stands in for a CUDA event of a copy that already happened (CPU engines)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _connector_class():
    """Build :class:`ChunkShardConnector` (imports vLLM; the engine imports this module)."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as ehs

    class ChunkShardConnector(ehs.ExampleHiddenStatesConnector):
        """vLLM's hidden-states connector, writing chunk shards instead of per-request files.

        Keeps the parent's scheduler side, block bookkeeping, extraction from the cache
        buffer and asynchronous device-to-host copy; replaces the per-request
        ``save_file`` with :class:`ChunkAssembler`. On a CPU engine (no CUDA streams) the
        copy is synchronous. Requires ``allow_custom_save_path`` (requests carry their
        route) and no synchronisation lock files.
        """

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._assembler = ChunkAssembler()

        def _write_tensors(self, tensors, event, filename, lock_fd) -> None:  # type: ignore[override]
            try:
                event.synchronize()
                chunk, pos = parse_route(filename)
                self._assembler.add(chunk, pos, tensors["hidden_states"], tensors["token_ids"])
            finally:
                if lock_fd is not None:
                    os.close(lock_fd)

        def _submit_async_write(self, pending) -> None:
            if self._kv_cache is None or self._kv_cache.device.type != "cpu":
                return super()._submit_async_write(pending)
            if not self._is_tp_rank_zero:
                return None
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
            hs = ehs.extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
            done = _Done()
            self._req_copy_events[pending.req_id] = done
            self._write_tensors({"hidden_states": hs, "token_ids": pending.token_ids.clone()}, done, pending.filename, None)
            return None

    return ChunkShardConnector


def __getattr__(name: str):
    # vLLM imports the connector class by name from this module (kv_connector_module_path)
    if name == CONNECTOR_NAME:
        cls = _connector_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def engine_overrides(layer_ids: Sequence[int], *, writer_threads: int = 8) -> dict:
    """``LLM`` keyword arguments that turn a target engine into a hidden-state extractor.

    ``speculative_config`` selects vLLM's ``extract_hidden_states`` method with the
    :func:`engine_layer_ids`; ``kv_transfer_config`` loads :class:`ChunkShardConnector`
    from this module. Prefix caching is off: a cached prefix would not pass through the
    forward and its states would be missing.
    """
    return {
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": engine_layer_ids(layer_ids)}},
        },
        "kv_transfer_config": {
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": __name__,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "allow_custom_save_path": True,
                "use_synchronization_lock": False,
                "num_writer_threads": writer_threads,
            },
        },
        "enable_prefix_caching": False,
    }


def wait_for_chunks(paths: Sequence[Path], *, timeout_s: float, poll_s: float = 0.05) -> None:
    """Block until every chunk file exists (the engine writes them asynchronously).

    Raises:
        RuntimeError: a chunk's ``.error`` file appeared (its text is the reason), or
            ``timeout_s`` seconds passed with chunks still missing (names them).
    """
    deadline = time.monotonic() + timeout_s
    missing = list(paths)
    while missing:
        for p in missing:
            if error_path(p).exists():
                raise RuntimeError(f"vLLM extraction failed writing {p}: {error_path(p).read_text().strip()}")
        missing = [p for p in missing if not Path(p).exists()]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM extraction: {len(missing)} chunk(s) not written after {timeout_s:.0f} s, e.g. {missing[0]}")
        time.sleep(poll_s)


def _vllm_extraction_replica(job: dict, rank: int, chunks) -> None:
    """One vLLM engine of an extraction job: prefill the chunks it takes from ``chunks``.

    Chunks go to the engine :data:`CHUNKS_PER_CALL` at a time, as one ``generate`` call of
    ``max_tokens=1`` requests (the sampled token is discarded); the engine writes each
    chunk shard asynchronously as soon as its last request is done, while the rest run. Writes ``replica-<rank>.json`` (model load seconds, extract seconds, tokens)
    into the job's chunk store, like the ``hf`` backend.
    """
    from vllm import SamplingParams, TokensPrompt

    from .engine import build_llm, shutdown_llm
    from .hygiene import ProcessRecord
    from .io import write_json_atomic
    from .resume import ChunkStore
    from .runtime import Timer, progress

    cfg, samples, ranges = job["cfg"], job["samples"], job["ranges"]
    store = ChunkStore.attach(job["out_shard"], ".safetensors")
    # the engine process imports the connector by module path
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])
    load = Timer()
    llm = build_llm(
        job["target"],
        job["engine"],
        seed=0,
        max_model_len=job["max_seq_len"] + 1,  # + the one sampled token
        trust_remote_code=job["trust_remote_code"],
        **engine_overrides(job["layer_ids"]),
    )
    load_s = load.seconds
    # the engine's processes, ended by the next full-model job if this one is killed
    stem = Path(job["out_shard"]).name.removesuffix(".safetensors")
    pids = ProcessRecord(Path(job["out_shard"]).parents[1] / ".pids", f"extract-{stem}" if rank == 0 else f"extract-{stem}.replica{rank}")
    pids.record()
    run = Timer()
    prefill_s = wait_s = 0.0  # inside generate calls; waiting for the engine's last chunk writes
    tokens = 0
    written: list[Path] = []
    bar = progress(
        total=sum(len(s.input_ids) for i in job["todo"] for s in samples[ranges[i][0] : ranges[i][1]]),
        desc="extract",
        unit="tok",
        unit_scale=True,
    )
    try:
        chunks = iter(chunks)
        while group := list(itertools.islice(chunks, CHUNKS_PER_CALL)):
            prompts, params = [], []
            for i in group:
                a, b = ranges[i]
                path = store.path(i)
                write_chunk_spec(
                    path, samples[a:b], layer_ids=job["layer_ids"], aux_layer_ids=job["aux"], storage_dtype=cfg["storage_dtype"]
                )
                prompts += [TokensPrompt(prompt_token_ids=s.input_ids.tolist()) for s in samples[a:b]]
                params += [
                    SamplingParams(
                        max_tokens=1,
                        temperature=0.0,
                        detokenize=False,
                        extra_args={"kv_transfer_params": {"hidden_states_path": route(path, k)}},
                    )
                    for k in range(b - a)
                ]
                written.append(path)
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            prefill_s += time.perf_counter() - t
            n = sum(len(p["prompt_token_ids"]) for p in prompts)
            tokens += n
            bar.update(n)
            logger.info("chunks %s of %d prefilled", [i + 1 for i in group], len(ranges))
        t = time.perf_counter()
        wait_for_chunks(written, timeout_s=WRITE_TIMEOUT_S)
        wait_s = time.perf_counter() - t
        extract_s = run.seconds  # before the engine's shutdown (seconds), like the hf backend
    finally:
        bar.close()
        shutdown_llm(llm)
        pids.clear()
    write_json_atomic(
        store.dir / f"replica-{rank}.json",
        {
            "rank": rank,
            "chunks": len(written),
            "model_load_seconds": load_s,
            "extract_seconds": extract_s,
            "prefill_seconds": prefill_s,
            "write_wait_seconds": wait_s,
            "tokens": tokens,
        },
    )
