"""Where the ``hf`` extraction backend's time goes: its batches against the bare forward.

The ``hf`` backend (``eagle3_pipeline.hf_backend.extract_hf``) runs transformers' decoder over
batches of samples of similar length, right-padded, with forward hooks that capture the aux
layers, then checks the states for NaN/Inf and copies them to the host, one batch at a time.
This script builds a Llama-3.1-8B-shaped target with random bf16 weights in memory (no files,
no tokenizer: token ids drawn at random; ``--layers`` cuts its depth), samples of 512-1,535
tokens (the range of ``vs_speculators.py``'s ShareGPT samples), and times on the same batches:

* ``forward``: the decoder alone (``model.model``) over the backend's padded batches, no hooks,
  no copies: what transformers' forward costs;
* ``extract_hf``: the backend's function itself, states copied to the host;
* ``batch1``: the decoder over one sample at a time (no padding, no mask), no copies, and
  ``padded_error``: how far the padded batch's states are from it (another batch shape's rounding);
* ``host_copy`` (GPU): one batch's states brought to the host, into pageable memory against
  a pinned buffer, as the backend copies into (``hf_backend.prefill_batches``);
* ``compiled_forward`` (``--compile``): ``forward`` with the decoder under ``torch.compile``
  (dynamic shapes), its first pass (compilation) timed apart, and ``compiled_extract_hf``:
  ``extract_hf`` itself with the compiled decoder (hooks included), after a whole pass, with its
  largest error against the eager ``extract_hf`` over 8 samples;
* ``writes_<way>_bt<N>`` (``--writes DIR``): the extraction job's loop, states written into a
  shard in ``DIR`` in chunks of 64 samples, two ways taking turns (twice each): ``per_chunk``,
  as the job did before: ``extract_hf`` over a chunk (each batch copied to the host, then each
  sample out of the pinned buffer), then one thread writes the chunk while the next is
  extracted; ``batch_writer``, as the job does now (``hf_backend.prefill_batches`` and
  ``BatchWriter``): each batch written straight from its pinned buffer while the GPU computes
  the next, with the writer's figures;
* ``cold_job_bt<N>`` and ``second_job_bt<N>`` (``--cold DIR``, which runs nothing else): the
  ``batch_writer`` job as the process's first GPU work after the model's build, then the same job
  again, with each batch's shape and main-thread seconds: what a process's first batches cost
  (CUDA set-up), to be run under the variables of ``COLD_START_ENV`` and in a second process;
  ``--fill-host-pool N`` first fills torch's pinned host pool with N buffers of each size the
  batches take (``fill_host_pool``), ``--cold-profile`` runs each job under ``torch.profiler``
  (device time per kernel class, and the host calls with most time); ``--cudnn-attention`` lets
  the jobs use cuDNN's attention, which ``hf_backend.attention_backends`` leaves out; then
  ``padded_error`` of the first batch under the jobs' attention backends;
* ``packed_<attn>`` (``--packed sdpa flex_attention``): the decoder over padding-free rows of up
  to ``batch_tokens`` tokens, samples back to back with positions restarting at 0, which
  transformers masks per sample in that attention implementation (flex attention skips the
  masked blocks; sdpa computes the whole row), with its largest error against batch 1;

each after a warm-up, with the GPU synchronized around it, and each a phase of its own in the
JSON (one that fails is recorded with its error; the rest still run). ``--profile`` adds a
``torch.profiler`` trace of ``extract_hf`` over the first batches: the GPU time per kernel
class (matrix products, attention, copies between host and device, the rest) and the share of
the wall time the GPU had no kernel running. MFU = tokens/s x 2 x parameters / ``--peak-tflops``
(790: a bf16 matrix product measured on the H200 and H100 here).

Run (GPU host: host torch and transformers suffice; CPU: ``--tiny``, a test-sized shape)::

    python benchmarks/hf_backend_profile.py --out benchmarks/results/hf_backend_profile_h200.json --profile --compile --packed sdpa flex_attention
    python benchmarks/hf_backend_profile.py --out writes.json --batch-tokens 8192 --writes /tmp/hfw   # the job's writes, before/after
    python benchmarks/hf_backend_profile.py --out cold.json --samples 512 --batch-tokens 8192 --cold /tmp/hfc   # a process's first batches
    .venv/bin/python benchmarks/hf_backend_profile.py --tiny --samples 6 --min-len 40 --max-len 90 --batch-tokens 256 --profile --packed sdpa   # CPU

On a CPU the kernel classes are empty (no device events) and MFU is against ``--peak-tflops``, a GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow_scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import phases  # noqa: E402

#: Variables that change a process's first CUDA work, recorded by ``--cold`` (run it under each)
COLD_START_ENV = ("CUDA_MODULE_LOADING", "PYTORCH_CUDA_ALLOC_CONF")

#: Llama-3.1-8B's shape (vs_speculators.py's target); ``--tiny``: a 2-core CPU's
SHAPES = {
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256},
    "tiny": {"hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096},
}


def build(shape: str, layers: int, device: str):
    """A random-weight ``LlamaForCausalLM`` of ``shape`` with ``layers`` decoder layers, bf16, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**SHAPES[shape], num_hidden_layers=layers, max_position_embeddings=2048, rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def make_samples(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list:
    """``n`` samples of ``lo``-``hi`` random token ids (uniform lengths), the backend's ``Sample`` form."""
    from eagle3_pipeline.shards import Sample

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = int(rng.integers(lo, hi + 1))
        out.append(Sample(f"{i:016x}", rng.integers(0, vocab, size=t).astype(np.int64), np.ones(t, dtype=bool)))
    return out


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def run_forward(model, samples, batch_tokens: int, device: str) -> None:
    """The decoder over ``make_batches``' padded batches: no hooks, no checks, no copies."""
    import torch

    from eagle3_pipeline.hf_backend import make_batches, pad_batch

    with torch.inference_mode():
        for batch in make_batches([len(s.input_ids) for s in samples], batch_tokens):
            ids, attn = pad_batch(samples, batch)
            model.model(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False)


def run_batch1(model, samples, device: str) -> None:
    """The decoder over one sample at a time (no padding, no mask)."""
    import torch

    with torch.inference_mode():
        for s in samples:
            model.model(input_ids=torch.from_numpy(s.input_ids)[None].to(device), use_cache=False)


def pack_rows(lengths: list[int], row_tokens: int) -> list[list[int]]:
    """Sample indices packed into rows of at most ``row_tokens`` tokens, longest first (next fit); a
    sample longer than ``row_tokens`` gets a row of its own."""
    rows: list[list[int]] = []
    used = row_tokens + 1
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if used + lengths[i] > row_tokens:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += lengths[i]
    return rows


def run_packed(model, samples, row_tokens: int, device: str, keep: int = 0) -> list:
    """The decoder over padding-free rows (:func:`pack_rows`): samples back to back, positions restarting
    at 0 for each and no attention mask, so that transformers masks attention within each sample
    (``masking_utils.find_packed_sequence_indices``) in the model's attention implementation. Returns
    the last layer's states ``[T_i, H]`` of the first ``keep`` samples (input order), for a check."""
    import torch

    lengths = [len(s.input_ids) for s in samples]
    kept: dict[int, torch.Tensor] = {}
    with torch.inference_mode():
        for row in pack_rows(lengths, row_tokens):
            ids = torch.cat([torch.from_numpy(samples[i].input_ids) for i in row])[None].to(device)
            pos = torch.cat([torch.arange(lengths[i]) for i in row])[None].to(device)
            out = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[0]
            a = 0
            for i in row:
                if i < keep:
                    kept[i] = out[a : a + lengths[i]].float().cpu()
                a += lengths[i]
    return [kept[i] for i in range(keep)]


def packed_error(model, samples, row_tokens: int, device: str, n: int = 4) -> float:
    """Largest relative error (Frobenius) of the packed forward's last-layer states against one sample at
    a time, over the first ``n`` samples."""
    import torch

    got = run_packed(model, samples, row_tokens, device, keep=n)
    errs = []
    with torch.inference_mode():
        for s, x in zip(samples[:n], got, strict=True):
            ref = model.model(input_ids=torch.from_numpy(s.input_ids)[None].to(device), use_cache=False).last_hidden_state[0].float().cpu()
            errs.append(((x - ref).norm() / ref.norm()).item())
    return max(errs)


def padded_error(model, samples, batch_tokens: int, device: str, n: int = 4) -> float:
    """Largest relative error (Frobenius) of the backend's padded batch's last-layer states against
    one sample at a time, over the samples of the first batch (at most ``n``): the rounding of
    another batch shape, the yardstick for the packed rows' error."""
    import torch

    from eagle3_pipeline.hf_backend import make_batches, pad_batch

    batch = make_batches([len(s.input_ids) for s in samples], batch_tokens)[0][:n]
    ids, attn = pad_batch(samples, batch)
    errs = []
    with torch.inference_mode():
        states = model.model(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False).last_hidden_state.float()
        for r, i in enumerate(batch):
            t = len(samples[i].input_ids)
            ref = (
                model.model(input_ids=torch.from_numpy(samples[i].input_ids)[None].to(device), use_cache=False).last_hidden_state[0].float()
            )
            errs.append(((states[r, :t] - ref).norm() / ref.norm()).item())
    return max(errs)


def host_copy(batch_tokens: int, layers: int, hidden: int, rounds: int = 3) -> dict:
    """Seconds to bring one batch's captured states (``batch_tokens`` x ``layers`` x ``hidden`` bf16)
    from the GPU to the host: into ordinary (pageable) memory, as the backend did, against
    a pinned buffer from torch's caching allocator, as ``hf_backend.prefill_batches`` copies into,
    and that plus a copy out of it on the host (what the backend kept before it wrote batches
    straight from the buffer)."""
    import torch

    x = torch.randn(batch_tokens, layers, hidden, device="cuda", dtype=torch.bfloat16)

    def pinned(x: torch.Tensor) -> torch.Tensor:
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        return host.copy_(x)

    def secs(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(rounds):
            fn()
        torch.cuda.synchronize()
        return round((time.perf_counter() - t) / rounds, 5)

    return {
        "bytes": x.numel() * x.element_size(),
        "pageable_seconds": secs(lambda: x.to("cpu")),
        "pinned_seconds": secs(lambda: pinned(x)),
        "pinned_and_copy_out_seconds": secs(lambda: pinned(x).clone()),
    }


def job_writes(
    model,
    samples,
    layer_ids: list[int],
    batch_tokens: int,
    folder: Path,
    way: str,
    chunk: int = 64,
    per_batch: bool = False,
    backends: list | None = None,
) -> dict:
    """The extraction job's loop over ``samples`` in chunks of ``chunk``, its states written into a
    fresh shard in ``folder``: ``per_chunk`` (the job before ``BatchWriter``: ``extract_hf`` per
    chunk, one chunk written by a thread while the next is extracted) or ``batch_writer`` (the job
    now). Returns seconds from the first forward to the last byte written (the shard created
    before), and the writer's figures for ``batch_writer``; ``per_batch`` (``batch_writer``): also
    ``batches``, each batch's ``[rows, longest sample's tokens, main-thread seconds]`` (from the
    previous batch handed to the writer to this one); ``backends``: the attention backends
    (``prefill_batches``' default where None)."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from eagle3_pipeline.hf_backend import BatchWriter, extract_hf, prefill_batches
    from eagle3_pipeline.resume import ChunkStore
    from eagle3_pipeline.shards import DONE_SUFFIX, ShardWriter

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rows = np.concatenate([[0], np.cumsum([len(s.input_ids) for s in samples])[:-1]]).tolist()
    ranges = [(a, min(a + chunk, len(samples))) for a in range(0, len(samples), chunk)]
    store = ChunkStore.attach(folder / "shard.safetensors", DONE_SUFFIX)
    store.dir.mkdir()
    kw = dict(layer_ids=layer_ids, aux_layer_ids=layer_ids[:-1], hidden_size=model.config.hidden_size, storage_dtype=torch.bfloat16)
    out: dict = {}
    with ShardWriter.create(folder / "partial.safetensors", samples, **kw) as shard, torch.inference_mode():
        t = time.perf_counter()
        if way == "per_chunk":

            def write(a: int, states: list) -> None:
                for k, x in enumerate(states):
                    shard.write_states(rows[a + k], x)

            with ThreadPoolExecutor(max_workers=1) as pool:
                pending = None
                for a, b in ranges:
                    states = extract_hf(model, samples[a:b], layer_ids, batch_tokens=batch_tokens, storage_dtype=torch.bfloat16)
                    if pending is not None:
                        pending.result()
                    pending = pool.submit(write, a, states)
                pending.result()
        else:
            writer = BatchWriter(shard, store, rows, len(ranges))
            trace, last = [], t
            for i, (a, b) in enumerate(ranges):
                for hb in prefill_batches(
                    model, samples[a:b], layer_ids, batch_tokens=batch_tokens, storage_dtype=torch.bfloat16, backends=backends
                ):
                    writer.batch(hb, a)
                    now = time.perf_counter()
                    trace.append([len(hb.lengths), hb.lengths[0], round(now - last, 3)])
                    last = now
                writer.chunk_done(i, a, b)
            if per_batch:
                out["batches"] = trace
            writer.close()
            out["writer"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in writer.stats.items()}
        seconds = time.perf_counter() - t
    shutil.rmtree(folder, ignore_errors=True)
    return {"seconds": seconds} | out


def fill_host_pool(samples, batch_tokens: int, layers: int, hidden: int, per_size: int, chunk: int = 64) -> dict:
    """Allocate, then free, ``per_size`` pinned host buffers of each power-of-two size the job's
    batches' states (bf16 ``[B, T_max, layers, hidden]``, batches as ``prefill_batches`` makes them per
    chunk of ``chunk`` samples) round up to, so torch's caching host allocator holds them when the
    job starts (it rounds each pinned allocation up to a power of two and reuses freed blocks of
    that size). Without a GPU (no pinned memory) it allocates nothing. Returns the sizes in bytes,
    the buffers allocated and the seconds taken."""
    import torch

    from eagle3_pipeline.hf_backend import make_batches

    sizes = set()
    for a in range(0, len(samples), chunk):
        lengths = [len(s.input_ids) for s in samples[a : a + chunk]]
        for batch in make_batches(lengths, batch_tokens):
            nbytes = len(batch) * lengths[batch[0]] * layers * hidden * 2
            sizes.add(1 << (nbytes - 1).bit_length())
    t = time.perf_counter()
    pin = torch.cuda.is_available()
    held = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sorted(sizes) for _ in range(per_size) if pin]
    seconds = time.perf_counter() - t
    return {"sizes_bytes": sorted(sizes), "per_size": per_size, "allocated": len(held), "seconds": round(seconds, 3)}


def profiled_span(fn, device: str):
    """``(fn(), prof)``: ``fn`` run under ``torch.profiler`` (CPU, and CUDA activity on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        got = fn()
    return got, prof


def host_calls(prof, n: int = 12) -> dict:
    """The ``n`` host events (operators, CUDA runtime calls such as ``cudaHostAlloc`` or
    ``cudaStreamSynchronize``) with the most CPU self time in a finished profile:
    ``{"host_top": [[seconds, name, calls], ...]}``."""
    from torch.autograd import DeviceType

    rows = [(e.self_cpu_time_total / 1e6, e.key[:80], e.count) for e in prof.key_averages() if e.device_type == DeviceType.CPU]
    return {"host_top": [[round(s, 4), k, c] for s, k, c in sorted(rows, reverse=True)[:n]]}


def measure(args, results: phases.Results) -> None:
    """Each measurement a phase of its own in ``results`` (``setup`` first): one that fails (a
    kernel the GPU lacks, memory) is recorded with its error and the others still run."""
    import torch

    from eagle3_pipeline.conventions import resolve_layer_ids
    from eagle3_pipeline.hf_backend import extract_hf
    from eagle3_pipeline.plan import estimate_params

    device = args.device
    t = time.perf_counter()
    model = build(args.shape, args.layers, device)
    build_s = time.perf_counter() - t
    params = estimate_params(model.config)
    samples = make_samples(args.samples, args.min_len, args.max_len, model.config.vocab_size)
    tokens = sum(len(s.input_ids) for s in samples)
    n = args.layers
    _aux, layer_ids = resolve_layer_ids(None, n)  # the default aux ids + the last layer, as extraction stores them
    results.put(
        "setup",
        {
            "shape": args.shape,
            "layers": n,
            "parameters": params,
            "samples": len(samples),
            "tokens": tokens,
            "layer_ids": layer_ids,
            "build_seconds": round(build_s, 2),
        },
    )

    def rate(seconds: float) -> dict:
        tps = tokens / seconds
        return {
            "seconds": round(seconds, 4),
            "tokens_per_second": round(tps, 1),
            "mfu": float(f"{tps * 2 * params / (args.peak_tflops * 1e12):.4g}"),
        }

    if args.cold:  # before anything else has run a kernel in this process
        bt = args.batch_tokens[0]
        if args.fill_host_pool:
            results.inline(
                "fill_host_pool", lambda: fill_host_pool(samples, bt, len(layer_ids), model.config.hidden_size, args.fill_host_pool)
            )
        from torch.nn.attention import sdpa_kernel

        from eagle3_pipeline.hf_backend import attention_backends

        backends = attention_backends(cudnn=args.cudnn_attention)
        for name in ("cold_job", "second_job"):

            def job() -> dict:
                run = lambda: job_writes(model, samples, layer_ids, bt, Path(args.cold), "batch_writer", per_batch=True, backends=backends)  # noqa: E731
                got, prof = profiled_span(run, device) if args.cold_profile else (run(), None)
                out = rate(got.pop("seconds")) | got | {"env": {k: os.environ.get(k) for k in COLD_START_ENV}}
                return out | (host_calls(prof) | phases.kernel_classes(prof, out["seconds"]) if prof else {})

            results.inline(f"{name}_bt{bt}", job)

        def parity() -> dict:
            with sdpa_kernel(backends):
                return {
                    "backends": [b.name for b in backends],
                    "max_rel_error_vs_batch1": round(padded_error(model, samples, bt, device), 5),
                }

        results.inline("padded_error", parity)
        return

    def timed(fn, warm_up) -> dict:
        warm_up()
        return rate(_timed(fn, device))

    def ext(part, bt: int) -> None:
        got = extract_hf(model, part, layer_ids, batch_tokens=bt, storage_dtype=torch.bfloat16)
        assert sum(x.shape[0] for x in got) == sum(len(s.input_ids) for s in part)
        assert got[0].shape[1:] == (len(layer_ids), model.config.hidden_size)

    warm = samples[: max(2, len(samples) // 16)]
    for bt in args.batch_tokens:
        results.inline(
            f"forward_bt{bt}",
            timed,
            lambda bt=bt: run_forward(model, samples, bt, device),
            lambda bt=bt: run_forward(model, warm, bt, device),
        )

        results.inline(f"extract_hf_bt{bt}", timed, lambda bt=bt: ext(samples, bt), lambda bt=bt: ext(warm, bt))
    if args.writes:
        bt = args.batch_tokens[0]
        job_writes(model, warm, layer_ids, bt, Path(args.writes), "batch_writer")  # warm-up
        for turn in (1, 2):
            for way in ("per_chunk", "batch_writer"):

                def writes(way=way) -> dict:
                    got = job_writes(model, samples, layer_ids, bt, Path(args.writes), way)
                    return rate(got.pop("seconds")) | got

                results.inline(f"writes_{way}_bt{bt}_{turn}", writes)
    results.inline("batch1", timed, lambda: run_batch1(model, samples, device), lambda: run_batch1(model, warm, device))
    results.inline(
        "padded_error", lambda: {"max_rel_error_vs_batch1": round(padded_error(model, samples, args.batch_tokens[0], device), 5)}
    )
    if device.startswith("cuda"):
        results.inline("host_copy", host_copy, args.batch_tokens[0], len(layer_ids), model.config.hidden_size)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
        part = samples[: max(4, len(samples) // 4)]
        bt = args.batch_tokens[0]

        def profiled() -> dict:
            _sync(device)
            with profile(activities=acts) as prof:
                wall = _timed(lambda: extract_hf(model, part, layer_ids, batch_tokens=bt, storage_dtype=torch.bfloat16), device)
            return {"samples": len(part)} | phases.kernel_classes(prof, wall)

        results.inline(f"profile_extract_hf_bt{bt}", profiled)
    # each switches the model's attention implementation (compile, after them, sets sdpa back)
    for impl in args.packed:  # padding-free rows in each attention implementation asked for
        model.set_attn_implementation(impl)
        for bt in args.batch_tokens:

            def packed(bt=bt) -> dict:
                run_packed(model, warm, bt, device)  # warm-up (flex attention compiles its kernel here)
                r = rate(_timed(lambda: run_packed(model, samples, bt, device), device))
                return r | {"max_rel_error_vs_batch1": round(packed_error(model, samples, bt, device), 5)}

            results.inline(f"packed_{impl}_bt{bt}", packed)
    if args.compile:  # the decoder under torch.compile (shapes marked dynamic), padded batches as the backend's
        model.set_attn_implementation("sdpa")  # the backend's (transformers' default for Llama)
        plain = model.model
        model.model = torch.compile(plain, dynamic=True)
        for bt in args.batch_tokens:

            def compiled(bt=bt) -> dict:
                t = time.perf_counter()
                run_forward(model, warm, bt, device)  # compiles (once, and again for shapes it cannot reuse)
                first = time.perf_counter() - t
                return rate(_timed(lambda: run_forward(model, samples, bt, device), device)) | {"first_pass_seconds": round(first, 1)}

            results.inline(f"compiled_forward_bt{bt}", compiled)
        bt = args.batch_tokens[0]
        model.model = plain
        ref = extract_hf(model, samples[:8], layer_ids, batch_tokens=bt, storage_dtype=torch.bfloat16)
        # compiled code is kept per code object and does not see hooks added after it was made:
        # without a reset, extract_hf's capture hooks would never run in the graphs compiled above
        torch.compiler.reset()
        model.model = torch.compile(plain, dynamic=True)

        def compiled_extract() -> dict:
            ext(samples, bt)  # a whole pass first: compilation, and shapes the first batches did not have
            r = rate(_timed(lambda: ext(samples, bt), device))
            got = extract_hf(model, samples[:8], layer_ids, batch_tokens=bt, storage_dtype=torch.bfloat16)
            err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, ref, strict=True))
            return r | {"max_rel_error_vs_eager": round(err, 5)}

        results.inline(f"compiled_extract_hf_bt{bt}", compiled_extract)
        model.model = plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON to write")
    ap.add_argument("--tiny", action="store_true", help="a test-sized shape (hidden 256) instead of Llama-3.1-8B's")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 32, or 8 with --tiny)")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--min-len", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=1535)
    ap.add_argument(
        "--batch-tokens", type=int, nargs="+", default=[8192, 16384], help="the backend's batch_tokens (default 8192 is the config's)"
    )
    ap.add_argument("--device", default=None, help="default: cuda when a GPU is visible, else cpu")
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--profile", action="store_true", help="add a torch.profiler breakdown of extract_hf")
    ap.add_argument(
        "--writes", metavar="DIR", help="also time the extraction job's writes into a shard in DIR, before and after BatchWriter"
    )
    ap.add_argument(
        "--cold",
        metavar="DIR",
        help="only: the job's loop (as --writes' batch_writer, shard in DIR) as the process's first GPU work, then again: "
        "each batch's main-thread seconds and shape, and the variables of COLD_START_ENV",
    )
    ap.add_argument(
        "--fill-host-pool",
        type=int,
        default=0,
        metavar="N",
        help="with --cold: first allocate and free N pinned buffers of each power-of-two size the job's batches take",
    )
    ap.add_argument(
        "--cudnn-attention",
        action="store_true",
        help="with --cold: the jobs may use cuDNN's attention (as torch chooses), which the backend leaves out by default",
    )
    ap.add_argument(
        "--cold-profile",
        action="store_true",
        help="with --cold: each job under torch.profiler, its device time per kernel class and the host calls with most time",
    )
    ap.add_argument("--compile", action="store_true", help="also time the padded forward with the decoder under torch.compile")
    ap.add_argument(
        "--packed",
        nargs="*",
        default=[],
        metavar="ATTN",
        help="also time padding-free rows (positions restarting per sample, no mask) in these attention implementations, "
        "e.g. sdpa flex_attention, checked against batch 1",
    )
    args = ap.parse_args()
    phases.fail_fast(phases.missing_packages(["torch", "transformers"]))
    import torch

    args.shape = "tiny" if args.tiny else "8b"
    args.layers = args.layers or (8 if args.tiny else 32)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    results = phases.Results(
        args.out,
        {
            "command": "python benchmarks/hf_backend_profile.py " + " ".join(sys.argv[1:]),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
        },
    )
    measure(args, results)
    print(json.dumps(results.data, indent=2))
    sys.exit(results.finish())


if __name__ == "__main__":
    main()
