"""The ``hf`` backend on quantized stand-ins, on the GPU (or CPU), against a float32 forward on CPU.

For each family named (tests/stand_ins.py: ``qwen3_fp8_blocks``, ``qwen3_moe_w4a16``,
``qwen3_w4a16``, ``qwen3_fp8``, ...) the stand-in is written under ``--work``, loaded by the
backend's own loader (``hf_backend.load_hf_target``) on ``--device``, and three chat-templated
prompts (plus 30 token ids each) are extracted at layers [2, 4, 5, 8]; the reference is the same
extraction from the float32 model of the dequantized checkpoint on CPU
(``tests/quant_support.dequantized_fp32``, written independently of both backends' kernels).
Per layer it reports the relative RMS error; a family passes below 2% (bf16 storage alone is
~0.3%; a state one layer off is 65-133%), or below 10% where the scheme rounds activations to fp8
(FP8 dynamic: 5.2-6.4% on an H100; ``tests/stand_ins.py``'s bounds and
``rounds_activations_to_fp8`` own both). It needs torch, transformers, compressed-tensors and the
family's tokenizer (``make resources/tokenizers/qwen3/tokenizer.json``), not vLLM.

An unknown family, or a missing tokenizer, stops it before the first check with exit status 2,
naming what to do. Run (the workflow's environment, ``make setup`` or ``envs/gpu-host-setup.sh``)::

    .venv/bin/python benchmarks/hf_quantized.py qwen3_fp8_blocks qwen3_moe_w4a16 qwen3_w4a16 --out benchmarks/results/hf_quantized_h100.json
    .venv/bin/python benchmarks/hf_quantized.py qwen3_fp8_blocks --device cpu    # on a CPU
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow_scripts"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import phases  # noqa: E402

PROMPTS = ["What is 2 + 2?", "Name a colour.", "Write a haiku about rain."]
LAYERS = [2, 4, 5, 8]


def write_stand_ins(families: list[str], work: Path) -> tuple[dict[str, Path], list[str]]:
    """Each family's stand-in under ``work`` (before any phase), and what stops it: an unknown family
    (with the known ones) or a missing tokenizer (with the command that fetches it)."""
    from stand_ins import FAMILIES, MissingTokenizer, stand_in

    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        return {}, [f"unknown family {', '.join(unknown)}: name one of {', '.join(FAMILIES)}"]
    targets, problems = {}, []
    for f in families:
        try:
            targets[f] = stand_in(f, work / f / "stand-in")
        except MissingTokenizer as e:
            problems.append(str(e))
    return targets, problems


def check_family(family: str, target: Path, device: str) -> dict:
    """The backend on ``device`` against the float32 CPU reference for one stand-in (see the module docstring)."""
    import numpy as np
    import torch
    from quant_support import dequantized_fp32
    from stand_ins import BF16_STATE_BOUND, FP8_ACTIVATION_STATE_BOUND, rounds_activations_to_fp8

    from eagle3_pipeline.hf_backend import extract_hf, load_hf_target
    from eagle3_pipeline.shards import Sample
    from eagle3_pipeline.target_model import load_tokenizer

    t0 = time.perf_counter()
    tok = load_tokenizer(target)
    samples = []
    for i, q in enumerate(PROMPTS):
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids) + list(range(1000 + i, 1030 + i))
        samples.append(Sample(f"{i:016x}", np.array(ids, dtype=np.int64), np.ones(len(ids), dtype=bool)))
    model = load_hf_target(str(target), device)
    on = str(next(model.parameters()).device)
    got = torch.cat(extract_hf(model, samples, LAYERS, batch_tokens=4096, storage_dtype=torch.bfloat16)).float()
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    ref = torch.cat(extract_hf(dequantized_fp32(target), samples, LAYERS, batch_tokens=4096, storage_dtype=torch.float32))
    errs = [((got[:, k] - ref[:, k]).pow(2).mean().sqrt() / ref[:, k].pow(2).mean().sqrt()).item() for k in range(len(LAYERS))]
    bound = FP8_ACTIVATION_STATE_BOUND if rounds_activations_to_fp8(family, "hf", on.startswith("cuda")) else BF16_STATE_BOUND
    return {
        "result": "passed" if max(errs) < bound else "failed",
        "bound": bound,
        "hf_on": on,
        "rel_rms_vs_fp32_cpu_per_layer": {str(layer): round(e, 5) for layer, e in zip(LAYERS, errs, strict=True)},
        "tokens": int(got.shape[0]),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("families", nargs="+", help="stand-ins of tests/stand_ins.py (FAMILIES), e.g. qwen3_fp8_blocks qwen3_moe_w4a16")
    ap.add_argument("--device", default=None, help="default: cuda when a GPU is visible, else cpu")
    ap.add_argument("--work", default=None, help="where the stand-ins are written (default: a temporary folder)")
    ap.add_argument("--out", help="JSON to write")
    args = ap.parse_args()
    phases.fail_fast(phases.missing_packages(["torch", "transformers", "compressed_tensors"]))
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    phases.fail_fast(phases.device_problems(device) + phases.unwritable([args.out], [args.work]))
    tmp = tempfile.TemporaryDirectory(prefix="hf-quantized-") if args.work is None else None
    work = Path(args.work or tmp.name)
    results = phases.Results(
        args.out,
        {
            "command": "python benchmarks/hf_quantized.py " + " ".join(sys.argv[1:]),
            "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
        },
    )
    targets, problems = write_stand_ins(args.families, work)
    phases.fail_fast(problems)
    for family, target in targets.items():
        r = results.inline(family, check_family, family, target, device)
        if r is not None:
            print(family, r, flush=True)
    failed = [f for f in args.families if (results.data["phases"].get(f) or {}).get("result") != "passed"]
    code = results.finish() or (1 if failed else 0)
    if tmp is not None:
        tmp.cleanup()
    sys.exit(code)


if __name__ == "__main__":
    main()
