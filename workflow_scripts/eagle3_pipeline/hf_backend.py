"""The ``hf`` extraction backend: prefill-only transformers forwards whose layer hooks capture the
hidden states (:class:`LayerCapture`), written into the job's shard (:mod:`eagle3_pipeline.shards`).

:mod:`eagle3_pipeline.hidden_states` runs the extraction job and picks this backend or
:mod:`eagle3_pipeline.vllm_extraction`.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterator, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .runtime import progress
from .shards import DONE_SUFFIX, FP8, STORAGE_DTYPES, RowsWritten, Sample, ShardWriter, mark_chunk_done

logger = logging.getLogger(__name__)


class LayerCapture:
    """Forward hooks that capture the residual stream at the given layer ids.

    Id ``0`` is the embedding output; id ``k >= 1`` is the output of decoder layer
    ``k - 1`` (so id ``n`` is the last layer's output before the final norm). Works for
    Hugging Face decoder models exposing ``model.model.embed_tokens`` and
    ``model.model.layers``.
    """

    def __init__(self, base_model, layer_ids: Sequence[int]):
        self.layer_ids = list(layer_ids)
        self.captured: dict[int, torch.Tensor] = {}
        self._handles = []
        layers = base_model.layers
        for k in self.layer_ids:
            module = base_model.embed_tokens if k == 0 else layers[k - 1]
            self._handles.append(module.register_forward_hook(self._hook(k)))

    def _hook(self, k: int):
        def fn(_module, _inputs, output):
            self.captured[k] = output[0] if isinstance(output, tuple) else output

        return fn

    def stacked(self) -> torch.Tensor:
        """Captured states stacked as ``[B, T, L, H]`` in ``layer_ids`` order."""
        return torch.stack([self.captured[k] for k in self.layer_ids], dim=2)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def load_hf_target(model_path: str, device: str = "auto", trust_remote_code: bool = False, dtype: str = "auto"):
    """Load the target with transformers for prefill (eval mode), in transformers' default
    attention: sdpa where it has it for the architecture, else its eager attention (gpt-oss's
    attention sinks have no sdpa path in transformers 5; asking for sdpa would refuse the model).

    ``device``: ``"auto"`` spreads the model over all visible GPUs (``device_map="auto"``)
    when there are several, uses the one GPU when there is one, else the CPU; or an
    explicit ``"cpu"``, ``"cuda"``, ``"cuda:N"``. ``dtype``: ``"auto"`` keeps the
    checkpoint's dtype, except on a CPU without fast bf16 where it loads float32
    (:func:`eagle3_pipeline.precision.resolve_dtype`); or a torch dtype name.

    A compressed-tensors checkpoint (W4A16, FP8, ...) is decompressed as it loads
    (transformers' ``run_compressed=False``): its weights are held dequantized in the
    checkpoint's compute dtype, and a scheme with quantized activations (FP8 dynamic) still
    quantizes them in each forward, as the checkpoint prescribes. transformers' default would
    decompress on the first call of the whole model, a hook that extraction, which calls the
    decoder without its head, never fires (every quantized layer then fails for want of a
    ``weight``). The fp8 format of DeepSeek-V3's and Qwen3's own releases (``quant_method:
    fp8``, 128 x 128 tiles) is dequantized as it loads as well (``FineGrainedFP8Config(
    dequantize=True)``): on a GPU transformers would run it through a kernel of the ``kernels``
    package, fetched from the model hub, which an offline host cannot.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

    from .precision import resolve_dtype

    kw: dict = {
        "dtype": resolve_dtype(dtype, device, "the hf backend's target") or "auto",
        "trust_remote_code": trust_remote_code,
    }
    quantization = getattr(AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code), "quantization_config", None)
    if isinstance(quantization, dict) and quantization.get("quant_method") == "compressed-tensors":
        kw["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
    elif isinstance(quantization, dict) and quantization.get("quant_method") == "fp8":
        kw["quantization_config"] = FineGrainedFP8Config(dequantize=True)
    if device == "auto" and torch.cuda.device_count() > 1:
        kw["device_map"] = "auto"
    elif device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    with warnings.catch_warnings():  # passing a quantized checkpoint's loading attributes is meant, not a mistake
        warnings.filterwarnings("ignore", message="You passed `quantization_config`", category=UserWarning)
        model = AutoModelForCausalLM.from_pretrained(model_path, **kw)
    return (model if "device_map" in kw else model.to(device)).eval()


def make_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group sample indices into batches of similar length.

    Samples are sorted by length (longest first); a batch grows while
    ``len(batch) * longest <= batch_tokens`` (padded tokens). A sample longer than
    ``batch_tokens`` gets a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = lengths[cur[0]] if cur else lengths[i]
        if cur and (len(cur) + 1) * longest > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def pad_batch(samples: Sequence[Sample], batch: Sequence[int], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples ``batch`` (indices into ``samples``, longest first, as :func:`make_batches` gives
    them) right-padded to the longest: ``(input_ids, attention_mask)``, both int64 ``[B, T_max]`` on
    CPU, the mask 1 on real tokens. Causal attention keeps real positions unaffected by the pads,
    which all lie after them."""
    t_max = len(samples[batch[0]].input_ids)
    ids = torch.full((len(batch), t_max), pad_id, dtype=torch.long)
    attn = torch.zeros((len(batch), t_max), dtype=torch.long)
    for r, i in enumerate(batch):
        n = len(samples[i].input_ids)
        ids[r, :n] = torch.from_numpy(samples[i].input_ids)
        attn[r, :n] = 1
    return ids, attn


class HostBatch:
    """One padded batch's captured states on their way to the host (:func:`prefill_batches`).

    Attributes:
        indices: the batch's samples, as positions in the ``samples`` given, in row order
            (longest first).
        lengths: their token counts, in the same order.
        states: ``[B, T_max, L, H]`` in the storage dtype, in host memory: on a GPU a pinned
            buffer that the device-to-host copy is still filling until :meth:`wait` returns; it
            stays this batch's while the object is held (torch's caching allocator of pinned
            memory hands it to a later batch only once it is freed and its copy is done). A copy
            into pageable memory instead ran at the driver's staging speed: 0.18 s (1.5 GB/s) for a
            batch of 8,192 tokens x 4 layers of an 8B target on an H100, against 4.9 ms into a pinned
            buffer (``host_copy`` in ``benchmarks/results/hf_backend_profile_after_h100.json``).
        pinned: whether ``states`` is such a buffer (a later batch reuses it once it is freed).
    """

    def __init__(self, indices: list[int], lengths: list[int], states: torch.Tensor, bad: torch.Tensor, ids: list[str], ready=None):
        self.indices, self.lengths, self.states = indices, lengths, states
        self._bad, self._ids, self._ready = bad, ids, ready
        self.pinned = ready is not None

    def wait(self) -> float:
        """Block until the states are in host memory; returns the seconds waited.

        Raises:
            FloatingPointError: a sample's states contain NaN or Inf (names the first such sample).
        """
        t = time.perf_counter()
        if self._ready is not None:
            self._ready.synchronize()
        waited = time.perf_counter() - t
        if bool(self._bad.any()):
            r = int(self._bad.nonzero()[0])
            raise FloatingPointError(f"sample {self._ids[r]}: hidden states contain NaN/Inf")
        return waited

    def rows(self) -> list[tuple[int, torch.Tensor]]:
        """``(position in samples, [T_i, L, H] view into states)`` per sample, after :meth:`wait`;
        the views share the batch's buffer (copy what must outlive this object)."""
        return [(i, self.states[r, :n]) for r, (i, n) in enumerate(zip(self.indices, self.lengths, strict=True))]


def attention_backends(cudnn: bool = False) -> list:
    """The scaled-dot-product attention backends the ``hf`` backend's forwards may use
    (``torch.nn.attention.sdpa_kernel``): flash, memory-efficient and math, and cuDNN's only where
    ``cudnn``. cuDNN's attention (torch's choice for a masked bf16 forward on an H100) builds an
    execution plan on the host for each new batch shape, and a job's padded batches rarely repeat
    a shape: on an H100, 8B shape, it left the GPU idle 29% of a job (2.6 s of host time over 36
    batches), and a job of 768 samples ran 6-7% longer with it than without it, though its
    kernels are 7% faster once a shape repeats (``benchmarks/results/hf_attention_backends_h100.json``)."""
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH] + ([SDPBackend.CUDNN_ATTENTION] if cudnn else [])


def prefill_batches(
    model,
    samples: Sequence[Sample],
    layer_ids: Sequence[int],
    *,
    batch_tokens: int,
    storage_dtype: torch.dtype,
    bar=None,
    backends: list | None = None,
) -> Iterator[HostBatch]:
    """Prefill ``samples`` through a transformers model in length-sorted padded batches
    (:func:`make_batches`, :func:`pad_batch`), capturing ``layer_ids`` (:class:`LayerCapture`).

    On a GPU nothing here waits for the GPU: each batch's finiteness check runs on the device, and
    its states (cast to ``storage_dtype``) and check result are copied into pinned host memory
    asynchronously, behind the forward on the same stream, so the caller can write one batch while
    the next is computed. The caller bounds how many batches it holds (each holds its buffer) and
    calls :meth:`HostBatch.wait` before reading one. On the CPU the states are ready at once.
    ``bar``: a progress bar (:func:`eagle3_pipeline.runtime.progress`) advanced by each batch's
    tokens, e.g. the whole job's; by default one of these samples' own. ``backends``: the
    attention backends the forwards may use (default :func:`attention_backends`).

    Yields:
        :class:`HostBatch` per batch, in :func:`make_batches` order.
    """
    device = model.get_input_embeddings().weight.device
    gpu = device.type == "cuda"
    cap = LayerCapture(model.model, layer_ids)
    lengths = [len(s.input_ids) for s in samples]
    own_bar = bar is None
    if own_bar:
        bar = progress(total=sum(lengths), desc="extract", unit="tok", unit_scale=True)
    try:
        for batch in make_batches(lengths, batch_tokens):
            ids, attn = pad_batch(samples, batch)
            if gpu:  # from pinned memory the copies need not wait for the batch before
                ids, attn = ids.pin_memory(), attn.pin_memory()
            attn = attn.to(device, non_blocking=gpu)
            with sdpa_kernel(backends or attention_backends()):
                model.model(input_ids=ids.to(device, non_blocking=gpu), attention_mask=attn, use_cache=False)
            states = cap.stacked()  # [B, T, L, H]
            cap.captured.clear()
            bad = ((~torch.isfinite(states).flatten(2).all(-1)) & attn.bool()).any(-1)  # [B]
            states = states.to(storage_dtype)
            ready = None
            if states.device.type == "cuda":
                host = torch.empty(states.shape, dtype=storage_dtype, pin_memory=True)
                host.copy_(states, non_blocking=True)
                bad_host = torch.empty(bad.shape, dtype=torch.bool, pin_memory=True)
                bad_host.copy_(bad, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(states.device))
                states, bad = host, bad_host
            yield HostBatch(batch, [lengths[i] for i in batch], states, bad, [samples[i].id for i in batch], ready)
            bar.update(sum(lengths[i] for i in batch))
    finally:
        if own_bar:
            bar.close()
        cap.remove()


@torch.inference_mode()
def extract_hf(
    model, samples: Sequence[Sample], layer_ids: Sequence[int], *, batch_tokens: int, storage_dtype: torch.dtype
) -> list[torch.Tensor]:
    """Prefill each sample through a transformers model and capture ``layer_ids``, in memory
    (:func:`prefill_batches`; the extraction job writes its batches into the shard instead).

    Samples are batched by length with right padding (causal attention: padded keys lie
    after every real position, so real positions are unaffected).

    Returns:
        per sample, ``[T_i, L, H]`` in ``storage_dtype`` on CPU, input order.

    Raises:
        FloatingPointError: a sample's states contain NaN or Inf (names the sample).
    """
    out: list[torch.Tensor | None] = [None] * len(samples)
    for hb in prefill_batches(model, samples, layer_ids, batch_tokens=batch_tokens, storage_dtype=storage_dtype):
        hb.wait()
        for i, x in hb.rows():  # a pinned buffer goes to a later batch: copy out what is kept
            out[i] = x.clone() if hb.pinned else x
    return out  # type: ignore[return-value]


class BatchWriter:
    """A thread that writes each batch's states into the shard as their copy arrives, and a chunk's
    done marker after its last batch: the extraction job's GPU computes the next batches meanwhile.

    At most ``depth`` batches wait in its queue (each holds its pinned buffer); :meth:`batch` and
    :meth:`chunk_done` block while the queue is full. An error in the thread (a NaN sample, a failed
    write) is raised by the next of them or by :meth:`close`, unchanged; chunks marked done before it are kept.

    ``stats``: batches, bytes, and seconds the thread spent waiting for the device-to-host copies
    (``copy_wait``) and writing (``write``), and the caller spent blocked on a full queue
    (``queue_full``).
    """

    def __init__(self, shard: ShardWriter, store, rows: Sequence[int], num_chunks: int, depth: int = 2):
        import queue
        import threading

        self._shard, self._store, self._rows, self._num_chunks = shard, store, rows, num_chunks
        self._written: dict[int, RowsWritten] = {}  # by sample index, until its chunk's marker records it
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self.stats = {"batches": 0, "bytes": 0, "copy_wait_seconds": 0.0, "write_seconds": 0.0, "queue_full_seconds": 0.0}
        self._thread = threading.Thread(target=self._run, name="shard-writer", daemon=True)
        self._thread.start()

    def batch(self, hb: HostBatch, first: int) -> None:
        """Write ``hb``, whose positions count from sample ``first`` of the job."""
        self._put(("batch", hb, first))

    def chunk_done(self, index: int, first: int, end: int) -> None:
        """Mark chunk ``index`` (samples ``first`` to ``end - 1``) done once its batches are written."""
        self._put(("done", index, first, end))

    def close(self, abort: bool = False) -> None:
        """Write what is queued (its finished chunks are marked done), stop the thread, and raise
        its error if any; ``abort`` (the caller is raising an error of its own): do not raise it."""
        if self._thread.is_alive():
            self._put(None, check=not abort)
            self._thread.join()
        if self._error is not None and not abort:
            raise self._error

    def _put(self, item, check: bool = True) -> None:
        import queue

        t = time.perf_counter()
        while True:
            if check and self._error is not None:
                raise self._error
            if not self._thread.is_alive():
                return
            try:
                self._queue.put(item, timeout=0.2)
                break
            except queue.Full:
                continue
        self.stats["queue_full_seconds"] += time.perf_counter() - t

    def _run(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                if item[0] == "batch":
                    _, hb, first = item
                    self.stats["copy_wait_seconds"] += hb.wait()
                    t = time.perf_counter()
                    for i, x in hb.rows():
                        self._written[first + i] = w = self._shard.write_states(self._rows[first + i], x)
                        self.stats["bytes"] += w.nbytes
                    self.stats["write_seconds"] += time.perf_counter() - t
                    self.stats["batches"] += 1
                else:
                    _, index, first, end = item
                    with self._store.writing(index) as marker:
                        mark_chunk_done(marker, [self._written.pop(k) for k in range(first, end)])
                    logger.info("chunk %d/%d done (samples %d-%d)", index + 1, self._num_chunks, first, end - 1)
        except BaseException as e:  # raised in the caller's thread
            if isinstance(e, OSError):  # a full disk, a folder made read-only: where, and what to do
                e.add_note(
                    f"while writing hidden states into {self._shard.path} or its chunk markers in {self._store.dir}; "
                    "the chunks marked done before it are kept: free the space (or fix the folder) and rerun to resume"
                )
            self._error = e
            while self._queue.get() is not None:  # let the caller's puts through until close
                pass


def extraction_replica(job: dict, rank: int, chunks) -> None:
    """One model replica of an extraction job: extract the chunks it takes from ``chunks``.

    Runs in the job's process (one replica) or in a spawned replica process
    (:func:`eagle3_pipeline.parallel.run_replicas`); a :class:`BatchWriter` writes each batch's
    states into the job's preallocated shard (:class:`eagle3_pipeline.shards.ShardWriter`) while
    the next batches are computed, then each chunk's done marker
    (:func:`eagle3_pipeline.shards.mark_chunk_done`); the replica's timing and the writer's
    figures (``writer``) go to ``replica-<rank>.json`` in the chunk store.
    """
    from .io import write_json_atomic
    from .precision import check_device_available
    from .resume import ChunkStore
    from .runtime import Timer

    cfg, samples, ranges, rows = job["cfg"], job["samples"], job["ranges"], job["rows"]
    todo_tokens = sum(len(s.input_ids) for i in job["todo"] for s in samples[ranges[i][0] : ranges[i][1]])
    store = ChunkStore.attach(job["out_shard"], DONE_SUFFIX)
    dtype = STORAGE_DTYPES[cfg["storage_dtype"]]
    compute_dtype = torch.bfloat16 if dtype == FP8 else dtype
    # a replica of several GPUs spreads the target's layers over them (device_map "auto")
    check_device_available(cfg["device"], "extraction.device")
    device = "auto" if (cfg.get("gpus_per_replica") or 1) > 1 and cfg["device"] in ("auto", "cuda") else cfg["device"]
    load = Timer()
    model = load_hf_target(job["target"], device, job["trust_remote_code"])
    load_s = load.seconds
    run = Timer()
    tokens = done = 0
    # one bar over the job's chunks still to do (a data-parallel replica advances it by its own batches)
    bar = progress(total=todo_tokens, desc="extract", unit="tok", unit_scale=True)
    with ShardWriter.open(job["shard_file"]) as shard, torch.inference_mode():
        writer = BatchWriter(shard, store, rows, len(ranges))
        try:
            for i in chunks:
                a, b = ranges[i]
                for hb in prefill_batches(
                    model, samples[a:b], job["layer_ids"], batch_tokens=cfg["batch_tokens"], storage_dtype=compute_dtype, bar=bar
                ):
                    writer.batch(hb, a)
                    del hb  # the writer holds the batch's pinned buffer until it is written
                n = sum(len(s.input_ids) for s in samples[a:b])
                writer.chunk_done(i, a, b)
                tokens += n
                done += 1
        except BaseException:
            writer.close(abort=True)
            raise
        writer.close()
    bar.close()
    extract_s = run.seconds
    del model  # give the GPU memory back before the job's next model (or a vLLM engine) loads
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    write_json_atomic(
        store.dir / f"replica-{rank}.json",
        {
            "rank": rank,
            "chunks": done,
            "model_load_seconds": load_s,
            "extract_seconds": extract_s,
            "tokens": tokens,
            "writer": writer.stats,
        },
    )
