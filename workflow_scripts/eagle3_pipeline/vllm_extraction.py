"""extract_hidden_states, ``vllm`` backend: prefill through vLLM, states written into the shard by the engine.

vLLM's ``extract_hidden_states`` speculative method makes the target return the hidden
states of the requested layers and caches them per token in a KV-cache-like buffer; a
KV connector copies a finished request's rows out of that buffer (vLLM's
``ExampleHiddenStatesConnector`` writes one safetensors file per request, the path
speculators 0.9 uses). :class:`ChunkShardConnector` subclasses that connector and keeps
its extraction and asynchronous device-to-host copy, but instead of a file per request
it writes each request's rows straight into the job's preallocated shard at the
sample's offset (:class:`eagle3_pipeline.shards.ShardWriter`), from the
connector's writer threads while the engine goes on. No per-sample files, no chunk
files to merge; the stored values are what the target computed, in the same format and
layer order as the ``hf`` backend.

How a request is routed: its ``kv_transfer_params["hidden_states_path"]`` is
``<chunk marker path>::<position>``; before submitting a chunk the driver writes
``<marker>.spec.json`` (the shard path, each sample's id, first row and input ids, the
layer ids). The marker appears (atomically) once all of the chunk's requests are in the
shard; a failure writes ``<marker>.error`` with the reason, which the driver raises.

The driver feeds requests to the engine continuously (``LLMEngine.add_request`` /
``step``), keeping :data:`QUEUED_REQUESTS` queued, so the batch never drains between
chunks.

Layer ids: vLLM's aux hidden-state id ``k`` is the embedding output for ``k = 0`` and the
residual stream after decoder layer ``k - 1`` otherwise (``hidden_states + residual``,
before the final norm for ``k = n``), the same convention as
:mod:`eagle3_pipeline.conventions`; vLLM returns them in ascending order, and the
connector reorders them to ``layer_ids`` order.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .io import atomic_path, write_json_atomic, write_text_atomic
from .layout import pids_of

logger = logging.getLogger(__name__)

#: Separator between a chunk path and a request's position in it (in ``hidden_states_path``).
ROUTE_SEP = "::"
CONNECTOR_NAME = "ChunkShardConnector"
#: Requests kept queued in the engine: a new chunk is added while fewer are unfinished.
QUEUED_REQUESTS = 512
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


def write_chunk_spec(marker, samples, *, shard: str | os.PathLike, rows: Sequence[int], layer_ids: Sequence[int]) -> None:
    """Write what the connector needs to store a chunk (``<marker>.spec.json``, atomically).

    Args:
        marker: the chunk's done-marker path (its requests' route).
        samples: :class:`eagle3_pipeline.shards.Sample` list, in chunk order.
        shard: the job's preallocated shard (:func:`eagle3_pipeline.shards.prepare_partial_shard`).
        rows: each sample's first token row in the shard.
        layer_ids: captured ids in stored order (``aux_layer_ids + [n]``).
    """
    spec = {
        "shard": str(shard),
        "sample_ids": [s.id for s in samples],
        "rows": [int(r) for r in rows],
        "input_ids": [s.input_ids.tolist() for s in samples],
        "layer_ids": list(layer_ids),
    }
    error_path(marker).unlink(missing_ok=True)
    write_text_atomic(spec_path(marker), json.dumps(spec))


def engine_layer_ids(layer_ids: Sequence[int]) -> list[int]:
    """The ids to request from vLLM: ``layer_ids`` sorted and de-duplicated (vLLM's output order)."""
    return sorted(set(layer_ids))


def all_finite(x: torch.Tensor) -> bool:
    """Whether ``x`` (any float dtype, any shape) holds no NaN and no +-Inf.

    One ``torch.aminmax`` pass, which propagates NaN (its documentation), instead of
    ``torch.isfinite(x).all()``: for one request of the 8B shape in bf16 (32.8 MB) on a CPU,
    1.7 ms against 48 ms (``benchmarks/writer_throughput.py``). The connector's writer threads
    check every request's states; that check was most of their work.
    """
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


class ChunkFiller:
    """Writes each request's states into its shard and marks a chunk done when all are in.

    Thread-safe: :meth:`add` is called from the connector's writer threads; shards are
    opened once per process (:meth:`eagle3_pipeline.shards.ShardWriter.open`).

    Args:
        stats_path: where to keep the writer threads' time (:meth:`stats`), rewritten before each
            chunk's done marker, so a driver that saw every marker reads the final figures; None:
            not kept.
    """

    def __init__(self, stats_path: str | None = None) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[dict, dict]] = {}  # marker: (spec, {position: RowsWritten})
        self._shards: dict = {}
        self._stats_path = stats_path
        self._seconds = {"copy_wait": 0.0, "check": 0.0, "write": 0.0}
        self._requests = self._bytes = 0
        self._last = {"last_copy_done": None, "last_write_done": None}
        self._stats_lock = threading.Lock()  # snapshots reach stats_path in the order they were taken

    def account(self, part: str, seconds: float) -> None:
        """Add ``seconds`` of one writer thread to ``part`` (``copy_wait``: the thread waiting for
        the request's device-to-host copy, timed by the connector; its end is stamped as
        ``last_copy_done``: when a writer thread had the copy, which is later than its arrival
        where every thread was busy), or of the engine's thread (``submit``: handing a finished
        request to the copy and the writers, on a GPU engine)."""
        with self._lock:
            self._seconds[part] = self._seconds.get(part, 0.0) + seconds
            if part == "copy_wait":
                self._last["last_copy_done"] = time.time()

    def stats(self) -> dict:
        """The writer threads' work so far: ``requests``, ``bytes`` written, ``seconds`` summed
        over the threads for each part (``copy_wait``, ``check``: ids, reorder and finiteness,
        ``write``: into the shard; on a GPU engine also ``submit``, the engine thread's), against which a driver sets its engine's prefill time, and
        when the last copy arrived and the last write ended (``last_copy_done``,
        ``last_write_done``: Unix time in seconds, None before the first), against which it sets
        the end of its prefill."""
        with self._lock:
            seconds = {k: round(v, 4) for k, v in self._seconds.items()}
            return {"requests": self._requests, "bytes": self._bytes, "seconds": seconds} | self._last

    def add(self, marker: str, position: int, hidden_states: torch.Tensor, token_ids: torch.Tensor) -> bool:
        """Check one request's states, write them at the sample's rows; mark the chunk done after the last.

        The states are checked, then written from the tensor vLLM handed over (its pinned
        copy buffer) where ``layer_ids`` is strictly ascending, as with the default ids, or from a copy
        in ``layer_ids`` order otherwise: a copy of a request's states (32.8 MB of the 8B
        shape) costs its writer thread ~5 ms (``benchmarks/writer_throughput.py``).

        Args:
            hidden_states: ``[T, L', H]`` as vLLM returns them (``L'`` = the
                :func:`engine_layer_ids`), any dtype, on CPU.
            token_ids: int ``[T]``, the request's prompt ids.

        Returns:
            True when this call completed the chunk (wrote its marker).

        Raises:
            ValueError: the token ids differ from the spec's sample, or the position is
                out of range; FloatingPointError: NaN/Inf states. Either is also written
                to ``<marker>.error`` for the driver.
        """
        from .shards import ShardWriter, mark_chunk_done

        try:
            with self._lock:
                if marker not in self._pending:
                    self._pending[marker] = (json.loads(spec_path(marker).read_text()), {})
                spec, done = self._pending[marker]
                if spec["shard"] not in self._shards:
                    self._shards[spec["shard"]] = ShardWriter.open(spec["shard"])
                shard = self._shards[spec["shard"]]
            if not 0 <= position < len(spec["sample_ids"]):
                raise ValueError(f"{marker}: position {position} outside the chunk's {len(spec['sample_ids'])} samples")
            t0 = time.perf_counter()
            states = self._check(marker, spec, position, hidden_states, token_ids)
            t1 = time.perf_counter()
            written = shard.write_states(spec["rows"][position], states)
            t2 = time.perf_counter()
            logger.debug("%s: sample %s, %.1f MB in %.3f s", spec["shard"], spec["sample_ids"][position], written.nbytes / 1e6, t2 - t1)
            with self._lock:
                self._seconds["check"] += t1 - t0
                self._seconds["write"] += t2 - t1
                self._last["last_write_done"] = time.time()
                self._requests += 1
                self._bytes += written.nbytes
                done[position] = written
                if len(done) < len(spec["sample_ids"]):
                    return False
                del self._pending[marker]
            if self._stats_path is not None:
                with self._stats_lock:
                    write_json_atomic(self._stats_path, self.stats())
            with atomic_path(marker) as tmp:
                mark_chunk_done(tmp, done.values())
            spec_path(marker).unlink(missing_ok=True)
            return True
        except Exception as e:
            with self._lock:
                self._pending.pop(marker, None)
            error_path(marker).write_text(f"{type(e).__name__}: {e}\n")
            raise

    @staticmethod
    def _check(marker: str, spec: dict, i: int, hs: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        """Sample ``i``'s states in ``layer_ids`` order, after checking ids, shape and finiteness."""
        sid = spec["sample_ids"][i]
        engine_ids = engine_layer_ids(spec["layer_ids"])
        ids = spec["input_ids"][i]
        if tok.shape[0] != len(ids) or tok.tolist() != ids:
            raise ValueError(
                f"{marker}: sample {sid}: the engine prefilled other token ids than the trace's ({tok.shape[0]} vs {len(ids)} tokens)"
            )
        if hs.shape[0] != len(ids) or hs.shape[1] != len(engine_ids):
            raise ValueError(f"{marker}: sample {sid}: states of shape {tuple(hs.shape)}, expected [{len(ids)}, {len(engine_ids)}, H]")
        order = [engine_ids.index(k) for k in spec["layer_ids"]]
        out = hs if order == list(range(len(order))) else hs.index_select(1, torch.tensor(order))
        if not all_finite(out):
            raise FloatingPointError(f"sample {sid}: hidden states contain NaN/Inf")
        return out


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
        """vLLM's hidden-states connector, writing into the job's shard instead of per-request files.

        Keeps the parent's scheduler side, block bookkeeping, extraction from the cache
        buffer and asynchronous device-to-host copy; replaces the per-request
        ``save_file`` with :class:`ChunkFiller`. On a CPU engine (no CUDA streams) the
        copy is synchronous. Requires ``allow_custom_save_path`` (requests carry their
        route) and no synchronisation lock files.
        """

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._filler = ChunkFiller(self._kv_transfer_config.get_from_extra_config("stats_path", None))

        def _write_tensors(self, tensors, event, filename, lock_fd) -> None:  # type: ignore[override]
            try:
                t = time.perf_counter()
                event.synchronize()
                self._filler.account("copy_wait", time.perf_counter() - t)
                chunk, pos = parse_route(filename)
                self._filler.add(chunk, pos, tensors["hidden_states"], tensors["token_ids"])
            finally:
                if lock_fd is not None:
                    os.close(lock_fd)

        def _submit_async_write(self, pending) -> None:
            if self._kv_cache is None or self._kv_cache.device.type != "cpu":
                # on the engine's own thread: the gather from the cache buffer, a pinned host
                # tensor for the request, the copy's launch (the parent's)
                t = time.perf_counter()
                out = super()._submit_async_write(pending)
                self._filler.account("submit", time.perf_counter() - t)
                return out
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


def writer_after_prefill(stats_path: Path, prefill_end: float) -> dict | None:
    """The engine's writer figures (:meth:`ChunkFiller.stats`, kept in ``stats_path``) with
    ``after_prefill_seconds``: how long after ``prefill_end`` (Unix time, when the driver had the
    last request's output) the last copy arrived and the last write ended (``copy``, ``write``);
    None where the engine kept no figures."""
    if not stats_path.is_file():
        return None
    w = json.loads(stats_path.read_text())
    stamps = {k: w.get(f"last_{k}_done") for k in ("copy", "write")}
    return w | {"after_prefill_seconds": {k: round(v - prefill_end, 4) for k, v in stamps.items() if v is not None}}


def engine_overrides(layer_ids: Sequence[int], *, writer_threads: int = 8, stats_path: str | None = None) -> dict:
    """``LLM`` keyword arguments that turn a target engine into a hidden-state extractor.

    ``speculative_config`` selects vLLM's ``extract_hidden_states`` method with the
    :func:`engine_layer_ids`; ``kv_transfer_config`` loads :class:`ChunkShardConnector`
    from this module, with ``writer_threads`` threads writing the states and the threads' time
    kept in ``stats_path`` (:meth:`ChunkFiller.stats`). Prefix caching is off: a cached prefix
    would not pass through the forward and its states would be missing.
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
                "stats_path": stats_path,
            },
        },
        "enable_prefix_caching": False,
    }


def unwritten_chunks(paths: Sequence[Path]) -> list[Path]:
    """The chunks of ``paths`` whose done marker is not there yet.

    Raises:
        RuntimeError: a chunk's ``.error`` file appeared (its text is the reason).
    """
    missing = []
    for p in paths:
        if not Path(p).exists():
            if error_path(p).exists():
                raise RuntimeError(f"vLLM extraction failed writing {p}: {error_path(p).read_text().strip()}")
            missing.append(p)
    return missing


def wait_for_chunks(paths: Sequence[Path], *, timeout_s: float, poll_s: float = 0.05) -> None:
    """Block until every chunk's done marker exists (the engine writes them asynchronously).

    Raises:
        RuntimeError: a chunk's ``.error`` file appeared (its text is the reason), or
            ``timeout_s`` seconds passed with chunks still missing (names them).
    """
    deadline = time.monotonic() + timeout_s
    while missing := unwritten_chunks(paths):
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM extraction: {len(missing)} chunk(s) not written after {timeout_s:.0f} s, e.g. {missing[0]}")
        time.sleep(poll_s)
        paths = missing


def extraction_max_model_len(target: str, max_seq_len: int, trust_remote_code: bool) -> tuple[int, bool]:
    """The extraction engine's ``max_model_len`` for samples of up to ``max_seq_len`` tokens.

    Every request asks for one output token, and vLLM's input processor refuses a prompt of
    ``max_model_len`` tokens or more, so the engine needs ``max_seq_len + 1``. Where that is one
    past the target's context length (vLLM's own derived ``max_model_len``: ``max_position_embeddings``
    and its kin in config.json, the tokenizer's ``model_max_length``, RoPE scaling), vLLM refuses it
    unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is set. Allowing it is safe here: the extra position
    belongs to the sampled token, which is discarded and never goes through a forward pass, so
    no position at or past the context length is computed.

    Args:
        target: the target's model directory.
        max_seq_len: the run's ``max_seq_len`` (tokens), the longest sample.
        trust_remote_code: as for loading the target.

    Returns:
        ``(max_model_len, allow_long)``: ``max_seq_len + 1``, and whether the engine must be
        told to accept it (``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``).

    Raises:
        InputError: ``max_seq_len`` exceeds the target's context length (generation under vLLM
            refuses it too), or vLLM cannot read the target's config
            (:func:`eagle3_pipeline.engine.target_context`).
    """
    from .engine import target_context

    context = target_context(target, trust_remote_code, max_seq_len)
    return max_seq_len + 1, max_seq_len == context


def vllm_extraction_replica(job: dict, rank: int, chunks) -> None:
    """One vLLM engine of an extraction job: prefill the chunks it takes from ``chunks``.

    Requests are ``max_tokens=1`` (the sampled token is discarded), fed to the engine
    continuously: a chunk's requests are added while fewer than :data:`QUEUED_REQUESTS`
    are unfinished, so the batch stays full until the last chunk. The engine writes each
    request's states into the shard as soon as it is prefilled and a chunk's done marker
    once all its requests are in. Writes ``replica-<rank>.json`` (model load, extract,
    prefill and write-wait seconds, tokens, and the writer threads' time per part,
    :meth:`ChunkFiller.stats`) into the job's chunk store, like the ``hf`` backend.
    """
    from vllm import SamplingParams, TokensPrompt

    from .engine import build_llm, feed_engine, shutdown_llm
    from .hygiene import ProcessRecord
    from .io import write_json_atomic
    from .resume import ChunkStore
    from .runtime import Timer, progress
    from .shards import DONE_SUFFIX

    samples, ranges, rows = job["samples"], job["ranges"], job["rows"]
    store = ChunkStore.attach(job["out_shard"], DONE_SUFFIX)
    # the engine process imports the connector by module path
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])
    stats_path = store.dir / f"writer-{rank}.json"  # the engine's writer threads' time (ChunkFiller.stats)
    stats_path.unlink(missing_ok=True)
    load = Timer()
    max_model_len, allow_long = extraction_max_model_len(job["target"], job["max_seq_len"], job["trust_remote_code"])
    if allow_long:
        os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    llm = build_llm(
        job["target"],
        job["engine"],
        seed=0,
        max_model_len=max_model_len,
        trust_remote_code=job["trust_remote_code"],
        **engine_overrides(job["layer_ids"], stats_path=str(stats_path)),
    )
    load_s = load.seconds
    # the engine's processes, ended by the next full-model job if this one is killed
    stem = Path(job["out_shard"]).name.removesuffix(".safetensors")
    pids = ProcessRecord(pids_of(job["out_shard"]), f"extract-{stem}" if rank == 0 else f"extract-{stem}.replica{rank}")
    pids.record()
    engine = llm.llm_engine
    run = Timer()
    tokens = 0
    written: list[Path] = []
    bar = progress(
        total=sum(len(s.input_ids) for i in job["todo"] for s in samples[ranges[i][0] : ranges[i][1]]),
        desc="extract",
        unit="tok",
        unit_scale=True,
    )
    outstanding: list[Path] = []  # chunks submitted and not yet marked done
    next_check = time.monotonic() + 1.0

    def add_chunk(i: int) -> None:
        a, b = ranges[i]
        marker = store.path(i)
        write_chunk_spec(marker, samples[a:b], shard=job["shard_file"], rows=rows[a:b], layer_ids=job["layer_ids"])
        for k, smp in enumerate(samples[a:b]):
            params = SamplingParams(
                max_tokens=1,
                temperature=0.0,
                detokenize=False,
                extra_args={"kv_transfer_params": {"hidden_states_path": route(marker, k)}},
            )
            engine.add_request(f"{i}-{k}", TokensPrompt(prompt_token_ids=smp.input_ids.tolist()), params)
        written.append(marker)
        outstanding.append(marker)

    def poll() -> None:  # stop early when the engine failed to store a chunk
        nonlocal outstanding, next_check
        if time.monotonic() > next_check:
            outstanding = unwritten_chunks(outstanding)
            next_check = time.monotonic() + 1.0

    def on_finished(out) -> None:
        nonlocal tokens
        n = len(out.prompt_token_ids)
        tokens += n
        bar.update(n)

    try:
        feed_engine(engine, chunks, add_chunk, on_finished, queued=QUEUED_REQUESTS, poll=poll)
        prefill_s, prefill_end = run.seconds, time.time()
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
            "writer": writer_after_prefill(stats_path, prefill_end),
        },
    )
