"""Where a train_drafter step's time goes: the training stage's own function under ``torch.profiler``.

``eagle3_pipeline.training.train`` runs as the workflow runs it, on either

* a finished run's hidden-state shards, draft vocabulary, target and ``training:`` settings
  (``--configfile``, as Snakemake takes it), or
* ``--synthetic 8b``: a Llama-3.1-8B-shaped target folder (its config, and random bf16
  embeddings, final norm and ``lm_head``: all the drafter reads of it) and one shard of random
  bf16 states at its default aux layers for samples of 512-1,535 tokens (the range of
  ``vs_speculators.py``'s ShareGPT samples), trained with ``vs_speculators.py``'s settings
  (8,192-token packs, a 32,000-id draft vocabulary, AdamW); ``--synthetic tiny`` is a test-sized
  shape for a CPU.

After ``--skip`` steps (compilation, first allocations) and one warm-up step the profiler
records ``--active`` steps. Per step it reports the host's seconds in each labelled part of the
step (``training.STEP_PHASES``: waiting for the loader's next pack, its copy to the device,
forward, backward, optimizer, the metrics' read-back, which waits for the device to finish the
step), the device's seconds per kernel class and its idle share (``phases.kernel_classes``),
and the tokens/s of the profiled steps (the profiler's own overhead included) beside that of the
second half of the skipped steps (no profiler).

Run (a GPU host with the workflow's environment, ``bash envs/gpu-host-setup.sh <wheelhouse>``)::

    .venv/bin/python benchmarks/train_profile.py --synthetic 8b --out benchmarks/results/train_profile_h200.json
    .venv/bin/python benchmarks/train_profile.py --configfile config/examples/smollm2-h200.yaml --out OUT.json
    .venv/bin/python benchmarks/train_profile.py --configfile config/config.yaml --skip 6 --active 6   # the CPU demo's run
    .venv/bin/python benchmarks/train_profile.py --synthetic tiny --skip 2 --active 3                  # seconds, on a CPU

Step ranges in the JSON are 1-based and inclusive. At the tiny shape the profiler's own cost is
most of a step (its operators are small), so the unprofiled rate is the one to read there.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow_scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import phases  # noqa: E402

#: target shape, samples and draft vocabulary of each synthetic setting
SYNTHETIC = {
    "8b": {
        "config": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8},
        "vocab_size": 128256,
        "layers": 32,
        "samples": 256,
        "lengths": (512, 1535),
        "draft_vocab": 32000,
        "pack_tokens": 8192,
    },
    "tiny": {
        "config": {"hidden_size": 128, "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2},
        "vocab_size": 2048,
        "layers": 8,
        "samples": 48,
        "lengths": (40, 90),
        "draft_vocab": 256,
        "pack_tokens": 256,
    },
}


def write_synthetic(kind: str, work: Path, seed: int = 0) -> dict:
    """Write the ``kind`` target folder, shard (+ index) and vocab under ``work``.

    Returns:
        ``{"target", "shards", "vocab_dir", "tokens", "samples", "layer_ids", "max_seq_len", "pack_tokens"}``.
    """
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from eagle3_pipeline.conventions import loss_mask, resolve_layer_ids
    from eagle3_pipeline.io import record_files, save_npy_atomic
    from eagle3_pipeline.shards import Sample, write_shard
    from eagle3_pipeline.vocab import build_mapping

    s = SYNTHETIC[kind]
    hidden, vocab = s["config"]["hidden_size"], s["vocab_size"]
    target = work / "target"
    target.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(**s["config"], vocab_size=vocab, num_hidden_layers=s["layers"], max_position_embeddings=8192, rope_theta=500000.0)
    cfg.save_pretrained(target)
    g = torch.Generator().manual_seed(seed)
    weights = {
        "model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=g) * 0.02).to(torch.bfloat16),
        "lm_head.weight": (torch.randn(vocab, hidden, generator=g) * 0.02).to(torch.bfloat16),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    aux, layer_ids = resolve_layer_ids(None, s["layers"])
    rng = np.random.default_rng(seed)
    samples, states, counts = [], [], np.zeros(vocab, dtype=np.int64)
    lo, hi = s["lengths"]
    for i in range(s["samples"]):
        n = int(rng.integers(lo, hi + 1))
        ids = rng.integers(0, vocab, size=n)
        n_prompt = n // 4
        samples.append(Sample(f"{i:016x}", ids, loss_mask(n_prompt, n - n_prompt)))
        np.add.at(counts, ids[n_prompt:], 1)
        states.append(torch.randn(n, len(layer_ids), hidden, generator=g, dtype=torch.bfloat16))
    shard = work / "shard-00000.safetensors"
    write_shard(shard, samples, states, layer_ids=layer_ids, aux_layer_ids=aux, index_path=work / "shard-00000.index.json")
    d2t, t2d = build_mapping(counts, s["draft_vocab"])
    save_npy_atomic(work / "vocab" / "d2t.npy", d2t)
    save_npy_atomic(work / "vocab" / "t2d.npy", t2d)
    record_files(work / "vocab")  # as build_vocab_mapping records them; training checks them
    return {
        "target": str(target),
        "shards": [str(shard)],
        "vocab_dir": str(work / "vocab"),
        "tokens": int(sum(len(x.input_ids) for x in samples)),
        "samples": len(samples),
        "layer_ids": layer_ids,
        "max_seq_len": hi + 1,
        "pack_tokens": s["pack_tokens"],
    }


def synthetic_training(pack_tokens: int) -> dict:
    """``vs_speculators.py``'s training settings (its ``TRAINING``) with ``pack_tokens``, validated with the schema's defaults."""
    from vs_speculators import TRAINING

    from eagle3_pipeline.config import validate_config

    return validate_config({"training": TRAINING | {"pack_tokens": pack_tokens}})["training"]


def run_inputs(configfiles: list[str], overrides: list[str]) -> tuple[dict, list[str]]:
    """A finished run's training inputs from its config (the run's layout), and what is missing."""
    from drafter_gap import load_config, target_dir

    from eagle3_pipeline.layout import RunLayout, shard_ids

    cfg = load_config(configfiles, overrides)
    layout = RunLayout(cfg["run"])
    shards = [layout.hidden_states(s) for s in shard_ids(cfg["prompts"]["num_shards"])]
    vocab = [layout.vocab("d2t"), layout.vocab("t2d")]
    missing = phases.missing_run_outputs([*shards, *vocab], configfiles)
    inputs = {
        "target": target_dir(cfg),
        "shards": [str(ROOT / p) for p in shards],
        "vocab_dir": str(ROOT / layout.vocab_dir()),
        "max_seq_len": cfg["max_seq_len"],
        "training": cfg["training"],
        "seed": cfg["seed"],
    }
    return inputs, missing


def profile_training(inputs: dict, cfg: dict, skip: int, active: int, work: Path, seed: int = 0) -> dict:
    """``training.train`` on ``inputs`` with ``cfg`` for ``skip + 1 + active`` steps, the last ``active`` profiled.

    Returns:
        ``{"steps", "profiled_steps", "seconds_per_step", "tokens_per_second", "unprofiled_steps",
        "unprofiled_tokens_per_second", "host_seconds_per_step": {part: s}, "device": {kernel
        classes, idle share}, "summary": train's summary (scalars)}``; steps are numbered from 1,
        ranges inclusive.

    Raises:
        RuntimeError: training ended before the profiled steps (too few packs: fewer ``--skip``/
            ``--active`` steps, or more samples).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from eagle3_pipeline.training import STEP_PHASES, resolve_device, train

    steps = skip + 1 + active
    cfg = {**cfg, "max_steps": steps, "checkpoint_every_steps": 0}
    device = resolve_device(cfg["device"])
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    marks: dict[int, tuple[float, int]] = {}  # step: (seconds, tokens seen) when it ended

    def on_step(step: int, tokens_seen: int) -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        marks[step] = (time.perf_counter(), tokens_seen)
        prof.step()

    with profile(activities=acts, schedule=schedule(wait=skip, warmup=1, active=active, repeat=1)) as prof:
        summary = train(
            inputs["shards"],
            inputs["vocab_dir"],
            inputs["target"],
            str(work / "drafter"),
            str(work / "metrics.jsonl"),
            cfg,
            seed=seed,
            max_seq_len=inputs["max_seq_len"],
            step_callback=on_step,
        )
    if summary["steps"] < steps:
        raise RuntimeError(f"training ended after {summary['steps']} steps, before the {active} profiled steps ended at step {steps}")
    first, last = skip + 1, steps  # the profiled steps are first+1 .. last
    wall = marks[last][0] - marks[first][0]
    out = {
        "steps": summary["steps"],
        "profiled_steps": [first + 1, last],
        "seconds_per_step": round(wall / active, 5),
        "tokens_per_second": round((marks[last][1] - marks[first][1]) / wall, 1),
        # the same loop before the profiler started recording (steps after the first half of the
        # skipped ones, which hold the compilation): the rate without the profiler's overhead
        "unprofiled_steps": [skip // 2 + 1, skip],
        "unprofiled_tokens_per_second": round((marks[skip][1] - marks[skip // 2][1]) / (marks[skip][0] - marks[skip // 2][0]), 1)
        if skip >= 2
        else None,
        "host_seconds_per_step": phases.range_host_seconds(prof, STEP_PHASES, active),
        "device": phases.kernel_classes(prof, wall),
        "summary": {k: v for k, v in summary.items() if not isinstance(v, list | dict)},
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--configfile", nargs="+", help="a finished run's config files, as given to snakemake")
    src.add_argument("--synthetic", choices=sorted(SYNTHETIC), help="random inputs of this shape (written under --work)")
    ap.add_argument("--config", nargs="*", default=[], help="YAML snippets applied last (with --configfile)")
    ap.add_argument("--skip", type=int, default=10, help="steps before the profiled ones (compilation, warm-up)")
    ap.add_argument("--active", type=int, default=8, help="steps profiled")
    ap.add_argument("--work", default=None, help="a folder for the synthetic inputs and the drafter (default: a temporary one)")
    ap.add_argument("--out", help="JSON to write")
    args = ap.parse_args()
    phases.fail_fast(
        phases.missing_packages(["speculators", *(["snakemake"] if args.configfile else [])])
        + phases.unwritable([args.out], [args.work])
        + ([f"--skip {args.skip}: give 0 or more steps"] if args.skip < 0 else [])
        + ([f"--active {args.active}: give 1 or more steps to profile"] if args.active < 1 else [])
    )
    tmp = tempfile.TemporaryDirectory(prefix="train-profile-") if args.work is None else None
    work = Path(args.work or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    results = phases.Results(args.out, {"command": " ".join(["python", *sys.argv])})
    if args.configfile:
        phases.fail_fast(phases.missing_paths({f: "give the run's config files, as given to snakemake" for f in args.configfile}))
        inputs, missing = run_inputs(args.configfile, args.config)
        phases.fail_fast(missing)
        results.put("inputs", {k: v for k, v in inputs.items() if k != "training"}, None)
        cfg, seed = inputs["training"], inputs["seed"]
    else:
        inputs = results.inline("inputs", write_synthetic, args.synthetic, work / "inputs", section=None)
        if inputs is None:
            sys.exit(results.finish())
        cfg, seed = synthetic_training(inputs["pack_tokens"]), 0
    results.inline("profile", profile_training, inputs, cfg, args.skip, args.active, work / "train", seed, section=None)
    doc = results.data.get("profile") or {}
    if "seconds_per_step" in doc:  # else the phase failed: finish() names it and its error
        print(f"{doc.get('tokens_per_second')} tok/s, {doc['seconds_per_step']} s/step; host per step: {doc['host_seconds_per_step']}")
        if doc["device"]["device_idle_share"] is not None:  # a GPU's kernels (none on a CPU)
            print(f"device: {doc['device']['device_seconds']}, idle {doc['device']['device_idle_share']}")
    code = results.finish()
    if tmp is not None:
        tmp.cleanup()
    sys.exit(code)


if __name__ == "__main__":
    main()
