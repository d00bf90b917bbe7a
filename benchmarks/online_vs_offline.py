"""Where τ goes: a finished run's drafter in vLLM on its own validation prompts and on the evaluation prompts.

train_drafter reports offline token accuracy on the validation split (the target's own
responses to held-out training prompts); evaluate_drafter measures acceptance in vLLM on
the evaluation prompts (MT-Bench). When the two disagree, this tells a train/serve mismatch
(acceptance on the validation prompts far below their offline accuracy) from a shift between
the prompt sets (acceptance on the validation prompts near it). It evaluates the run's drafter
in vLLM on ``--prompts`` validation prompts with the run's settings, prints τ and acceptance
per position beside the offline accuracy and the run's own evaluation, and writes ``--out``.

``--variant NAME`` takes a sweep variant's drafter (``results/<run>/sweep/NAME/``) instead of
the run's. ``--num-speculative-tokens`` and ``--max-tokens`` change k and the answer length
of this measurement only. Offline accuracy is token-weighted over whole responses (up to
``generation.max_tokens``), while vLLM's per-position rates are per draft step and cover the
first ``evaluation.max_tokens`` tokens: k = 1 with the generation's length is the closest
online counterpart of offline ``full_acc_0``.

The run's files it reads (hidden states, prompts, the evaluation's ``acceptance.json``, the
drafter) are checked first, a missing one named with the Snakemake command that makes it;
when the measurement fails, ``--out`` holds its error and the script exits 1.

Run after the run itself (``make setup`` on a CPU machine, ``bash envs/gpu-host-setup.sh
<wheelhouse>`` on a GPU host)::

    .venv/bin/python benchmarks/online_vs_offline.py --configfile config/config.yaml --prompts 40 \\
        --out benchmarks/results/online_vs_offline_cpu.json
    (GPU: --configfile config/examples/smollm2-h200.yaml --prompts 200 [--variant quarter])
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow_scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import phases  # noqa: E402

from eagle3_pipeline.config import validate_config  # noqa: E402
from eagle3_pipeline.io import read_json, read_jsonl  # noqa: E402
from eagle3_pipeline.layout import BUILTIN_TARGET_DIR, RunLayout, shard_ids  # noqa: E402
from eagle3_pipeline.shards import ShardReader  # noqa: E402
from eagle3_pipeline.training import split_items  # noqa: E402


def validation_questions(run: Path, val_fraction: float, limit: int) -> list[dict]:
    """The first ``limit`` validation samples' prompts (training's own split), as evaluation questions."""
    readers = [ShardReader(p) for p in sorted((run / "hidden_states").glob("shard-?????.safetensors"))]
    _, val = split_items(readers, val_fraction)
    ids = [readers[s].sample_ids[i] for s, i in val][:limit]
    by_id = {r["id"]: r for p in sorted((run / "prompts").glob("shard-?????.jsonl")) for r in read_jsonl(p)}
    questions = []
    for sid in ids:
        users = [m["content"] for m in by_id[sid]["messages"] if m["role"] == "user"]
        questions.append({"id": sid, "turns": users[:1]})
    return questions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configfile", default=str(ROOT / "config" / "config.yaml"))
    ap.add_argument("--prompts", type=int, default=40, help="validation prompts to evaluate")
    ap.add_argument("--variant", help="a sweep variant of the run: evaluate its drafter instead of the run's")
    ap.add_argument("--num-speculative-tokens", type=int, help="k for this measurement (default: the evaluation's)")
    ap.add_argument("--max-tokens", type=int, help="answer length for this measurement (default: evaluation.max_tokens)")
    ap.add_argument("--out")
    args = ap.parse_args()
    phases.fail_fast(phases.missing_packages(["vllm"]))
    # vLLM would fork its engine after CUDA was initialised here (on an H200: "Cannot
    # re-initialize CUDA in forked subprocess"); the script is import-safe for spawn
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    base = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cfg = validate_config(base | yaml.safe_load(Path(args.configfile).read_text()))
    run = ROOT / "results" / cfg["run"]
    builtin = cfg["target"]["path"].startswith("builtin:")
    target = str(phases.embedded_target()) if builtin else cfg["target"]["path"]
    layout = RunLayout(cfg["run"])
    own_layout = layout.variant(args.variant) if args.variant else layout
    shards = shard_ids(cfg["prompts"]["num_shards"])
    needed = [own_layout.acceptance(), *(layout.hidden_states(s) for s in shards), *(layout.prompt_shard(s) for s in shards)]
    needed += [] if args.variant else [layout.drafter()]  # a variant's drafter is named in its acceptance.json
    problems = phases.missing_run_outputs(needed + ([BUILTIN_TARGET_DIR] if builtin else []), [args.configfile])
    phases.fail_fast(problems + ([] if builtin else phases.missing_paths({target: "the config's target.path names no model folder"})))
    own_dir = run / "sweep" / args.variant if args.variant else run
    own = read_json(own_dir / "eval" / "acceptance.json")
    drafter = Path(own["drafter"]) if args.variant else run / "drafter"  # a variant may use the run's drafter
    k = args.num_speculative_tokens or own["num_speculative_tokens"]
    results = phases.Results(
        args.out,
        {
            "run": cfg["run"],
            "variant": args.variant,
            "drafter": str(drafter),
            "num_speculative_tokens": k,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
        },
    )
    phases.fail_fast(phases.missing_paths({drafter: "the variant's acceptance.json names a drafter that is gone: train it again"}))
    t0 = time.perf_counter()
    measured = results.inline("validation_prompts", measure, cfg, args, target, run, drafter, k, section=None)
    if measured is not None:
        offline = own.get("offline_validation", {})
        results.data |= {
            "max_tokens": measured.pop("max_tokens"),
            "evaluation_prompts": {  # the evaluate_drafter job's own measurement (its k and max_tokens)
                "n": own["num_prompts"],
                "num_speculative_tokens": own["num_speculative_tokens"],
                "tau": own["acceptance_length"],
                "per_position": own["per_position_acceptance_rate"],
            },
            "offline_full_acc": [offline.get(f"full_acc_{i}") for i in range(k)],
            "offline_tau": 1 + sum(offline.get(f"full_acc_{i}") or 0 for i in range(k)),
            "seconds": round(time.perf_counter() - t0, 1),
        }
    print(json.dumps(results.data, indent=1))
    sys.exit(results.finish())


def measure(cfg: dict, args: argparse.Namespace, target: str, run: Path, drafter: Path, k: int) -> dict:
    """τ and acceptance per position of ``drafter`` in vLLM on the run's first ``args.prompts`` validation prompts:
    ``{"n", "tau", "per_position", "max_tokens"}``."""
    from eagle3_pipeline.engine import build_llm, shutdown_llm
    from eagle3_pipeline.evaluation import eval_prompt_ids, run_eval
    from eagle3_pipeline.target_model import load_tokenizer

    eval_cfg = cfg["evaluation"] | {"num_speculative_tokens": k, "max_tokens": args.max_tokens or cfg["evaluation"]["max_tokens"]}
    questions = validation_questions(run, cfg["training"]["val_fraction"], args.prompts)
    spec = {"method": "eagle3", "model": str(drafter.resolve()), "num_speculative_tokens": k}
    llm = build_llm(target, cfg["vllm"], seed=cfg["seed"], max_model_len=cfg["max_seq_len"], speculative_config=spec)
    try:
        report, _, _ = run_eval(
            llm,
            questions,
            eval_prompt_ids(load_tokenizer(target), questions, cfg["generation"]["chat_template_kwargs"]),
            eval_cfg,
        )
    finally:
        shutdown_llm(llm)
    return {
        "n": len(questions),
        "tau": report["acceptance_length"],
        "per_position": report["per_position_acceptance_rate"],
        "max_tokens": eval_cfg["max_tokens"],
    }


if __name__ == "__main__":
    main()
