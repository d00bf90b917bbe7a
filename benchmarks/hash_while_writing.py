"""Extraction's SHA-256: taken while the shard is filled against read back after it.

An extraction job records its shard's SHA-256 in the index. It used to read the whole shard
back once the last chunk was done (``sha256_file``); it now hashes the shard's final prefix in
a thread while the replicas fill it (``eagle3_pipeline.shards.ShardHasher``). This script fills
a shard of the layout extraction writes (``ShardWriter``, bf16, 4 layers of hidden size 4,096,
samples of 1,000 tokens) chunk by chunk at a set rate, with a done marker per chunk
(``ChunkStore``, as the replicas do), in two phases that take turns:

* ``after``: fill, then ``sha256_file`` the shard (what the job did before);
* ``while``: fill with a ``ShardHasher`` following the done markers, then ``hexdigest()``.

Each phase's figure is the ``tail``: seconds from the last chunk's marker to the digest, the
time the job adds after its last token. The fill rate stands for the target's prefill: the
default, 1.2 GB/s, is the rate at which extraction wrote states on one H100 with the README's
GPU example (38 GB in 31.5 s of tokens, benchmarks/results/full_example_h100.json) and on an
H200 with the 8B-shaped target (37K tok/s x 4 layers x 4,096 x 2 bytes). The digests of the
phases are checked equal (``after``'s is ``hashlib`` over the finished file).

Run (CPU or GPU host, after ``make setup`` or ``envs/gpu-host-setup.sh``)::

    .venv/bin/python benchmarks/hash_while_writing.py --out benchmarks/results/hash_while_writing_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow_scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import phases  # noqa: E402

LAYERS, HIDDEN, SAMPLE_TOKENS = 4, 4096, 1000


def fill(work: Path, gib: float, gbps: float, chunk_samples: int, follow: bool) -> dict:
    """Fill one shard of ``gib`` GiB at ``gbps`` GB/s; hash it while (``follow``) or after filling.

    Returns ``{"fill_seconds", "tail_seconds", "fill_gbps", "sha256", "bytes"}``.
    """
    import torch

    from eagle3_pipeline.io import sha256_file
    from eagle3_pipeline.resume import ChunkStore
    from eagle3_pipeline.shards import DONE_SUFFIX, Sample, ShardHasher, ShardWriter, mark_chunk_done

    n = max(chunk_samples, int(gib * 2**30 / (SAMPLE_TOKENS * LAYERS * HIDDEN * 2)))
    rng = np.random.default_rng(0)
    samples = [
        Sample(f"{i:016x}", rng.integers(0, 128_000, SAMPLE_TOKENS).astype(np.int64), np.arange(SAMPLE_TOKENS) >= 100) for i in range(n)
    ]
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    final = work / "shard-00000.safetensors"
    store = ChunkStore(final, "benchmark", DONE_SUFFIX)
    path = store.dir / "shard.safetensors"
    states = torch.randn(chunk_samples * SAMPLE_TOKENS, LAYERS, HIDDEN, generator=torch.Generator().manual_seed(0)).to(
        torch.bfloat16
    )  # one chunk's rows, reused
    chunk_rows = [(a * SAMPLE_TOKENS, min(a + chunk_samples, n) * SAMPLE_TOKENS) for a in range(0, n, chunk_samples)]
    writer = ShardWriter.create(
        path, samples, layer_ids=[1, 2, 3, 4], aux_layer_ids=[1, 2, 3], hidden_size=HIDDEN, storage_dtype=torch.bfloat16
    )
    hasher = ShardHasher(path, chunk_rows)
    row_bytes = LAYERS * HIDDEN * 2
    with writer, hasher.following(store.finished) if follow else contextlib.nullcontext() as followed:
        t0 = time.perf_counter()
        for i, (a, b) in enumerate(chunk_rows):
            with store.writing(i) as marker:
                mark_chunk_done(marker, [writer.write_states(a, states[: b - a])])
            due = t0 + b * row_bytes / (gbps * 1e9)  # the prefill's pace
            time.sleep(max(0.0, due - time.perf_counter()))
        filled = time.perf_counter()
        behind = hasher.size - hasher.hashed if follow else hasher.size
        sha = followed.hexdigest() if follow else sha256_file(path)
        tail = time.perf_counter() - filled
    size = path.stat().st_size
    if follow and sha != sha256_file(path):  # checked outside the timing
        raise AssertionError(f"{path}: the digest taken while filling differs from the file's")
    os.sync()
    return {
        "bytes": size,
        "fill_seconds": round(filled - t0, 3),
        "fill_gbps": round(size / (filled - t0) / 1e9, 3),
        "tail_seconds": round(tail, 3),
        "unhashed_bytes_at_last_chunk": behind,
        "sha256": sha,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON to write (rewritten after each phase)")
    ap.add_argument("--gib", type=float, default=4.0, help="shard size (GiB)")
    ap.add_argument("--gbps", type=float, default=1.2, help="fill rate (GB/s), the prefill's pace")
    ap.add_argument("--chunk-samples", type=int, default=2, help="samples of 1,000 tokens per chunk")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the two phases; the figure is each phase's fastest tail")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "hash_while_writing"))
    args = ap.parse_args()
    phases.fail_fast(phases.missing_packages(["torch", "safetensors"]))
    phases.fail_fast(phases.short_of_disk(args.work, args.gib * 2**30, "--work elsewhere, or --gib"))
    results = phases.Results(args.out, phases.host_record(__file__))
    runs: dict[str, list[dict]] = {"after": [], "while": []}
    for r in range(args.rounds):
        for name, follow in (("after", False), ("while", True)):
            got = results.inline(f"{name}_{r}", fill, Path(args.work), args.gib, args.gbps, args.chunk_samples, follow)
            if got is not None:
                runs[name].append(got)
    shutil.rmtree(args.work, ignore_errors=True)
    if all(runs.values()):
        best = {k: min(v, key=lambda x: x["tail_seconds"]) for k, v in runs.items()}
        shas = {x["sha256"] for v in runs.values() for x in v}
        results.put(
            "summary",
            {
                "bytes": best["after"]["bytes"],
                "fill_gbps_target": args.gbps,
                "tail_seconds_after": best["after"]["tail_seconds"],
                "tail_seconds_while": best["while"]["tail_seconds"],
                "seconds_saved": round(best["after"]["tail_seconds"] - best["while"]["tail_seconds"], 3),
                "sha256_gbps_after": round(best["after"]["bytes"] / best["after"]["tail_seconds"] / 1e9, 3),
                "digests_equal": len(shas) == 1,
            },
            section=None,
        )
        if len(shas) != 1:
            results.fail("summary", f"the phases' digests differ: {sorted(shas)}", None, section=None)
    print(json.dumps(results.data, indent=2))
    sys.exit(results.finish())


if __name__ == "__main__":
    main()
