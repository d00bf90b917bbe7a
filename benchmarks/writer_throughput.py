"""The `vllm` extraction backend's writer path: can it keep up with the engine's prefill?

vLLM's hidden-states connector hands each finished request's states to writer threads in the
engine's process; ours (``vllm_extraction.ChunkFiller.add``) checks them (token ids, shape, no
NaN/Inf), reorders the layers into a new tensor where ``layer_ids`` is not ascending (vLLM's
order; the ``parts`` phase times that copy), and writes them at the sample's rows of the shard. Whatever those threads cannot keep up with waits after the last token: on one H100, the
8B-shaped target's extraction waited 0.86 s after 10.05 s of prefill (``write_wait_seconds``,
``results/vs_speculators_h100.json``), 0.897 x vLLM's prefill-only rate.

On requests of the 8B shape (1,000 tokens, 4 stored layers of 4,096 in bf16, 32.8 MB; vLLM
hands 4 layers in ascending id order), this script times:

* ``parts``: one thread, per request, each step of ``add`` alone: the reorder
  (``index_select``), the finiteness check as it was (``torch.isfinite(x).all()``) and as it is
  (``vllm_extraction.all_finite``), and ``ShardWriter.write_states`` (a write into the page
  cache);
* ``filler_<n>``: ``ChunkFiller.add`` itself from ``n`` threads over ``--requests`` requests into
  a new shard (writer threads, as vLLM's ``num_writer_threads``; the pipeline asks for 8), the
  median of ``--rounds``, in GB/s, beside
  the rate the prefill produces (``--prefill-gbps``, default 1.42: 43.4K tok/s x 32.8 KB on the
  H100).

Run (CPU or GPU host, after ``make setup`` or ``envs/gpu-host-setup.sh``)::

    .venv/bin/python benchmarks/writer_throughput.py --out benchmarks/results/writer_throughput_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow_scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import phases  # noqa: E402

TOKENS, HIDDEN = 1000, 4096
LAYER_IDS = [2, 16, 29, 32]  # stored order (aux ids + the last layer); vLLM hands them sorted


def _requests(work: Path, n: int):
    """A shard of ``n`` samples and one chunk spec routing them; the states vLLM would hand over."""
    import torch

    from eagle3_pipeline.shards import Sample, ShardWriter
    from eagle3_pipeline.vllm_extraction import write_chunk_spec

    rng = np.random.default_rng(0)
    samples = [Sample(f"{i:016x}", rng.integers(0, 128_000, TOKENS).astype(np.int64), np.arange(TOKENS) >= 100) for i in range(n)]
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shard = work / "shard.safetensors"
    ShardWriter.create(
        shard, samples, layer_ids=LAYER_IDS, aux_layer_ids=LAYER_IDS[:-1], hidden_size=HIDDEN, storage_dtype=torch.bfloat16
    ).close()
    marker = work / "chunk-000000.done"
    write_chunk_spec(marker, samples, shard=shard, rows=[i * TOKENS for i in range(n)], layer_ids=LAYER_IDS)
    states = torch.randn(TOKENS, len(LAYER_IDS), HIDDEN, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    return marker, shard, samples, states


def parts(work: Path, repeats: int) -> dict:
    """Milliseconds per request of each step of ``ChunkFiller.add``, one thread (the median of ``repeats``)."""
    import torch

    from eagle3_pipeline.shards import ShardWriter
    from eagle3_pipeline.vllm_extraction import all_finite

    _, shard, _, states = _requests(work, 1)
    order = torch.tensor([sorted(LAYER_IDS).index(k) for k in LAYER_IDS])
    writer = ShardWriter.open(shard)
    steps = {
        "index_select": lambda: states.index_select(1, order),
        "isfinite_all (before)": lambda: bool(torch.isfinite(states).all()),
        "all_finite (now)": lambda: all_finite(states),
        "write_states": lambda: writer.write_states(0, states),
    }
    out = {}
    for name, fn in steps.items():
        fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        ms = float(np.median(times)) * 1000
        out[name] = {"ms_per_request": _sig(ms), "gbps": _sig(states.numel() * 2 / ms / 1e6)}
    writer.close()
    return {"request_bytes": states.numel() * 2, "torch_threads": torch.get_num_threads()} | out


def _sig(x: float) -> float:
    """``x`` to 3 significant digits: a figure of a slow machine keeps its precision (0.137, not 0.14)."""
    return float(f"{x:.3g}")


def filler(work: Path, requests: int, threads: int, prefill_gbps: float, rounds: int) -> dict:
    """``ChunkFiller.add`` from ``threads`` threads over ``requests`` requests into a new shard, ``rounds``
    times: each round's seconds, and the median round's GB/s against the prefill's."""
    rates = [_fill_once(work, requests, threads) for _ in range(rounds)]
    gbps = float(np.median(rates))
    return {
        "threads": threads,
        "requests": requests,
        "round_gbps": [_sig(x) for x in rates],
        "gbps": _sig(gbps),
        "vs_prefill": round(gbps / prefill_gbps, 2),
    }


def _fill_once(work: Path, requests: int, threads: int) -> float:
    import torch

    from eagle3_pipeline.vllm_extraction import ChunkFiller

    marker, _, samples, states = _requests(work, requests)
    fill = ChunkFiller()
    ids = [torch.from_numpy(s.input_ids) for s in samples]
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:  # as vLLM's writer threads; an add's error is raised here
        list(pool.map(lambda i: fill.add(str(marker), i, states, ids[i]), range(requests)))
    secs = time.perf_counter() - t
    if not marker.exists():
        raise RuntimeError(f"{marker}: the chunk was not marked done")
    os.sync()  # the next round starts without this one's dirty pages
    return requests * states.numel() * 2 / secs / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON to write (rewritten after each phase)")
    ap.add_argument("--requests", type=int, default=64, help="requests of 1,000 tokens per filler phase (32.8 MB each)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 8], help="writer threads of the filler phases")
    ap.add_argument("--repeats", type=int, default=20, help="parts: timings per step (the median is kept)")
    ap.add_argument("--rounds", type=int, default=3, help="filler: rounds per thread count (the median is kept)")
    ap.add_argument("--prefill-gbps", type=float, default=1.42, help="the rate the prefill produces states at (GB/s)")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "writer_throughput"))
    args = ap.parse_args()
    phases.fail_fast(phases.missing_packages(["torch", "safetensors"]))
    problems = phases.unwritable([args.out], [args.work])
    if min(args.requests, *args.threads, args.repeats, args.rounds) < 1:
        problems.append("--requests, --threads, --repeats and --rounds must be at least 1")
    if not problems:
        need = args.requests * TOKENS * len(LAYER_IDS) * HIDDEN * 2
        problems += phases.short_of_disk(args.work, need, "--work elsewhere, or fewer --requests")
    phases.fail_fast(problems)
    results = phases.Results(args.out, phases.host_record(__file__))
    work = Path(args.work)
    results.inline("parts", parts, work, args.repeats)
    for n in args.threads:
        results.inline(f"filler_{n}", filler, work, args.requests, n, args.prefill_gbps, args.rounds)
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(results.data, indent=2))
    sys.exit(results.finish())


if __name__ == "__main__":
    main()
