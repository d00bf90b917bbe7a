"""The training loader's read rate: tokens/s one loader process turns into drafter inputs.

Writes a shard of random SmolLM2-shaped states (576 hidden, 5 stored aux layers + the final
one, like ``config/examples/smollm2-h200-layers.yaml``) as bf16 and as fp8, then times
``ShardDataset`` items (read, dequantise, concatenate) in one process with one thread, for a
drafter on 3 of the 5 aux layers and on all 5, against reading every stored layer first and
selecting after (how ``ShardDataset`` read before it passed its layers to
``ShardReader.sample``). A GPU training step consumes ``loader_workers`` times this rate at
most; on the H200 the fp8 run of 2026-12-02 trained at 91K tok/s with 4 workers
(docs/offline-gpu-host.md, `benchmarks/results/gpu_fp8_h200.json`).

Each storage dtype is a phase: ``--out`` is rewritten after each, a failed one is recorded
with its error and the script exits 1 at the end.

Run (CPU, after ``make setup``)::

    .venv/bin/python benchmarks/loader.py --out benchmarks/results/loader_cpu.json
"""

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow_scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import phases  # noqa: E402

from eagle3_pipeline.conventions import loss_mask  # noqa: E402
from eagle3_pipeline.shards import (  # noqa: E402
    Sample,
    ShardReader,
    write_shard,
)
from eagle3_pipeline.training import ShardDataset  # noqa: E402

LAYERS = [2, 8, 15, 22, 27, 30]


def rate(fn, n: int, tokens: int, reps: int) -> float:
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        for i in range(n):
            fn(i)
        best = max(best, tokens / (time.perf_counter() - t))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    samples, states = [], []
    for i in range(args.samples):  # 170 prompt + 370 completion tokens: the H200 run's means
        samples.append(Sample(f"{i:016x}", rng.integers(0, 49152, size=540), loss_mask(170, 370)))
        states.append(torch.randn(540, len(LAYERS), 576, dtype=torch.bfloat16))
    tokens = 540 * args.samples
    results = phases.Results(
        args.out,
        {
            "command": "python benchmarks/loader.py" + (f" --out {args.out}" if args.out else ""),
            "cpu": platform.processor() or platform.machine(),
        },
    )

    def read_rates(path: Path, dtype: torch.dtype) -> dict:
        """Tokens/s of ``ShardDataset`` items from a ``dtype`` shard written at ``path``, per aux-layer choice."""
        write_shard(path, samples, states, layer_ids=LAYERS, aux_layer_ids=LAYERS[:-1], index_path=None, storage_dtype=dtype)
        r = ShardReader(path)
        items = [(0, i) for i in range(args.samples)]
        row = {}
        for name, cols in (("3 of 5 aux layers", [0, 2, 4]), ("all 5 aux layers", None)):
            ds = ShardDataset([r], items, 4096, torch.bfloat16, cols)
            want = cols if cols is not None else [0, 1, 2, 3, 4]

            def read_all_then_select(i, want=want, r=r):
                hs = r.sample(i)["hidden_states"]
                return hs[:, want].reshape(540, -1), hs[:, 5]

            row[name] = {
                "tokens_per_second": round(rate(ds._get_raw_data, args.samples, tokens, args.reps)),
                "read_every_layer_then_select_tokens_per_second": round(rate(read_all_then_select, args.samples, tokens, args.reps)),
            }
        return row

    with tempfile.TemporaryDirectory() as d:
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            results.inline(str(dtype).removeprefix("torch."), read_rates, Path(d) / f"{dtype}.safetensors", dtype, section=None)
    print(json.dumps(results.data, indent=1))
    sys.exit(results.finish())


if __name__ == "__main__":
    main()
