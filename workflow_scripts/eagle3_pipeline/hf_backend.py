"""The ``hf`` extraction backend: prefill-only transformers forwards whose layer hooks capture the
hidden states (:class:`LayerCapture`), written into the job's shard (:mod:`eagle3_pipeline.shards`).

:mod:`eagle3_pipeline.hidden_states` runs the extraction job and picks this backend or
:mod:`eagle3_pipeline.vllm_extraction`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence

import torch

from .runtime import progress
from .shards import DONE_SUFFIX, FP8, STORAGE_DTYPES, Sample, ShardWriter, mark_chunk_done

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


def to_host(x: torch.Tensor) -> torch.Tensor:
    """``x`` in host memory: itself when it is there already, else copied from the GPU through a
    page-locked (pinned) buffer, which the caller copies what it keeps out of before the next call.

    A copy from the GPU into ordinary (pageable) memory runs at the speed of the driver's own
    staging: for a batch of 8,192 tokens x 4 layers of an 8B target (268 MB, H100) 0.18 s
    (1.5 GB/s), against 4.9 ms into a pinned buffer and 29-31 ms with the copy out of it on the
    host (``host_copy`` in ``benchmarks/results/hf_backend_profile_after_h100.json``); before,
    the copies took as much GPU time as the batches' matrix products. The buffer comes from
    torch's caching allocator of pinned memory, which hands the freed block to the next batch
    instead of pinning new memory each time.
    """
    if x.device.type == "cpu":
        return x
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x)
    return host


@torch.inference_mode()
def extract_hf(
    model, samples: Sequence[Sample], layer_ids: Sequence[int], *, batch_tokens: int, storage_dtype: torch.dtype
) -> list[torch.Tensor]:
    """Prefill each sample through a transformers model and capture ``layer_ids``.

    Samples are batched by length with right padding (causal attention: padded keys lie
    after every real position, so real positions are unaffected). Each batch's states reach the
    host through page-locked memory (:func:`to_host`).

    Returns:
        per sample, ``[T_i, L, H]`` in ``storage_dtype`` on CPU, input order.

    Raises:
        FloatingPointError: a sample's states contain NaN or Inf (names the sample).
    """
    device = model.get_input_embeddings().weight.device
    base = model.model
    cap = LayerCapture(base, layer_ids)
    out: list[torch.Tensor | None] = [None] * len(samples)
    lengths = [len(s.input_ids) for s in samples]
    try:
        bar = progress(total=sum(lengths), desc="extract", unit="tok", unit_scale=True)
        for batch in make_batches(lengths, batch_tokens):
            ids, attn = pad_batch(samples, batch)
            attn = attn.to(device)
            base(input_ids=ids.to(device), attention_mask=attn, use_cache=False)
            states = cap.stacked()  # [B, T, L, H]
            # one finiteness check and one device-to-host copy per batch (not per sample)
            bad = (~torch.isfinite(states).flatten(2).all(-1)) & attn.bool()  # [B, T]
            if bad.any():
                r = int(bad.any(-1).nonzero()[0])
                raise FloatingPointError(f"sample {samples[batch[r]].id}: hidden states contain NaN/Inf")
            host = to_host(states.to(storage_dtype))
            pinned = states.device.type != "cpu"  # the buffer is the next batch's: copy out what is kept
            for r, i in enumerate(batch):
                out[i] = host[r, : lengths[i]].clone() if pinned else host[r, : lengths[i]]
            cap.captured.clear()
            bar.update(sum(lengths[i] for i in batch))
        bar.close()
    finally:
        cap.remove()
    return out  # type: ignore[return-value]


def extraction_replica(job: dict, rank: int, chunks) -> None:
    """One model replica of an extraction job: extract the chunks it takes from ``chunks``.

    Runs in the job's process (one replica) or in a spawned replica process
    (:func:`eagle3_pipeline.parallel.run_replicas`); writes each chunk's states into the
    job's preallocated shard (:class:`eagle3_pipeline.shards.ShardWriter`), then the chunk's done marker
    (:func:`eagle3_pipeline.shards.mark_chunk_done`), and its timing to ``replica-<rank>.json`` in the chunk store.
    """
    from concurrent.futures import ThreadPoolExecutor

    from .io import write_json_atomic
    from .precision import check_device_available
    from .resume import ChunkStore
    from .runtime import Timer

    cfg, samples, ranges, rows = job["cfg"], job["samples"], job["ranges"], job["rows"]
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
    shard = ShardWriter.open(job["shard_file"])

    def write(i: int, a: int, b: int, states: list[torch.Tensor]) -> None:
        with store.writing(i) as marker:
            for k, x in enumerate(states):
                shard.write_states(rows[a + k], x)
            mark_chunk_done(marker, b - a, sum(len(x.input_ids) for x in samples[a:b]))
        logger.info("chunk %d/%d done (samples %d-%d)", i + 1, len(ranges), a, b - 1)

    # a chunk is written by a background thread while the next one is extracted (one in flight)
    with shard, ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as pool:
        pending = None
        for i in chunks:
            a, b = ranges[i]
            states = extract_hf(model, samples[a:b], job["layer_ids"], batch_tokens=cfg["batch_tokens"], storage_dtype=compute_dtype)
            if pending is not None:
                pending.result()
            pending = pool.submit(write, i, a, b, states)
            tokens += sum(len(s.input_ids) for s in samples[a:b])
            done += 1
        if pending is not None:
            pending.result()
    extract_s = run.seconds
    del model  # give the GPU memory back before the job's next model (or a vLLM engine) loads
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    write_json_atomic(
        store.dir / f"replica-{rank}.json",
        {"rank": rank, "chunks": done, "model_load_seconds": load_s, "extract_seconds": extract_s, "tokens": tokens},
    )
