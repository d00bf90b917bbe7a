"""Random training inputs shared by test_train_resume.py and test_parallel.py."""

from pathlib import Path

import numpy as np
import torch

from eagle3_pipeline.conventions import loss_mask
from eagle3_pipeline.io import save_npy_atomic
from eagle3_pipeline.shards import Sample, write_shard
from eagle3_pipeline.vocab import build_mapping


def write_random_train_inputs(d: Path, num_samples: int) -> Path:
    """``d/shard-00000.safetensors`` (+ index) of random SmolLM2-shaped states and ``d/vocab/``.

    Samples have 10-39 prompt + 20-59 completion tokens with ids below 600, hidden states
    ``[T, 4, 576]`` bf16 at layer ids [2, 15, 27, 30]; the draft vocabulary is 512 ids of
    the 49,152. Returns the shard path.
    """
    rng = np.random.default_rng(0)
    samples, states = [], []
    for i in range(num_samples):
        n_p, n_c = int(rng.integers(10, 40)), int(rng.integers(20, 60))
        samples.append(Sample(f"{i:016x}", rng.integers(0, 600, size=n_p + n_c), loss_mask(n_p, n_c)))
        states.append(torch.randn(n_p + n_c, 4, 576, dtype=torch.bfloat16))
    shard = d / "shard-00000.safetensors"
    write_shard(shard, samples, states, layer_ids=[2, 15, 27, 30], aux_layer_ids=[2, 15, 27], index_path=d / "shard-00000.index.json")
    counts = np.zeros(49152, dtype=np.int64)
    counts[:600] = 1
    d2t, t2d = build_mapping(counts, 512)
    save_npy_atomic(d / "vocab" / "d2t.npy", d2t)
    save_npy_atomic(d / "vocab" / "t2d.npy", t2d)
    return shard


def backends_vs_fp32(ref, hf, vllm, layers) -> list[tuple[int, float, float]]:
    """Per stored layer, ``(layer id, hf error, vllm error)``: each backend's states ``[T, L, H]``
    against a float32 forward's ``ref``, as root-mean-square error relative to the reference's RMS
    (bf16 storage alone gives ~0.3%)."""
    out = []
    for k, layer in enumerate(layers):
        r = ref[:, k]
        rms = r.pow(2).mean().sqrt()
        out.append((layer, ((hf[:, k] - r).pow(2).mean().sqrt() / rms).item(), ((vllm[:, k] - r).pow(2).mean().sqrt() / rms).item()))
    return out
