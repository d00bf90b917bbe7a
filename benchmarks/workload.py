"""Workload figures the plan assumes before a run has traces: templated prompt tokens per prompt.

For each ``prompts.turns`` setting (``first``, ``multi``, ``each``), the default config's prompt
set (the built-in ShareGPT, decontaminated against MT-Bench, every prompt: ``max_prompts: null``)
built as rule prepare_prompts builds it, each prompt rendered with the embedded target's chat
template (SmolLM2's) as generation renders it, the prompts that leave
``generation.min_completion_tokens`` within ``max_seq_len`` kept as generation keeps them; then
their mean prompt tokens. ``references.json``'s ``workload`` holds the figures (the prompt counts:
:data:`eagle3_pipeline.plan.SHAREGPT_PROMPTS_BY_TURNS`, the means:
:data:`eagle3_pipeline.plan.PROMPT_TOKENS_BY_TURNS`). The embedded target's tokenizer is
made first by Snakemake (rule prepare_target_model) when it is missing.

Prints JSON with, per setting, the prompts read, kept and rejected, their mean tokens and the
figure the plan uses; ``--out`` writes it too. Takes about 3 minutes on 2 cores.

Run (CPU, after ``make setup``)::

    .venv/bin/python benchmarks/workload.py --out benchmarks/results/workload.json
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow_scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import phases  # noqa: E402

from eagle3_pipeline.config import validate_config  # noqa: E402
from eagle3_pipeline.generation import render_prompt_ids  # noqa: E402
from eagle3_pipeline.plan import PROMPT_TOKENS_BY_TURNS, SHAREGPT_PROMPTS_BY_TURNS  # noqa: E402
from eagle3_pipeline.prompts import Decontaminator, build_prompt_set, load_eval_questions  # noqa: E402


def prompt_tokens(turns: str, tokenizer, max_prompts: int | None = None) -> dict:
    """The default config's prompt set under ``prompts.turns = turns`` (its first ``max_prompts``;
    None: all), rendered with ``tokenizer``: counts and the mean templated prompt tokens of the
    prompts generation keeps."""
    cfg = validate_config({"prompts": {"turns": turns, "max_prompts": max_prompts}})
    questions = load_eval_questions(cfg["evaluation"]["prompts"])
    decon = Decontaminator((q["id"], t) for q in questions for t in q["turns"]) if cfg["prompts"]["decontaminate"] else None
    ps = build_prompt_set(cfg["prompts"]["sources"], turns=turns, max_prompts=max_prompts, decontaminator=decon)
    room = cfg["max_seq_len"] - cfg["generation"]["min_completion_tokens"]
    lengths = [len(render_prompt_ids(tokenizer, r["messages"], cfg["generation"]["chat_template_kwargs"])) for r in ps.records]
    kept = [n for n in lengths if n <= room]
    return {
        "prompts": len(ps.records),
        "kept": len(kept),
        "too_long": len(lengths) - len(kept),
        "prompt_tokens": sum(kept),
        "mean_prompt_tokens": round(sum(kept) / len(kept), 1),
        "plan_uses": PROMPT_TOKENS_BY_TURNS[turns],
        "plan_prompts": SHAREGPT_PROMPTS_BY_TURNS[turns],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--log", default=str(Path(tempfile.gettempdir()) / "workload-target.log"), help="making the embedded target")
    ap.add_argument("--tokenizer", help="a tokenizer folder (default: the embedded target's, made when missing)")
    ap.add_argument("--max-prompts", type=int, help="the first N prompts of each set (default: all)")
    args = ap.parse_args()
    if args.tokenizer:
        phases.fail_fast(phases.missing_packages(["transformers"]) + phases.missing_paths({args.tokenizer: "give a tokenizer folder"}))
    else:
        phases.fail_fast(phases.missing_packages(["transformers"]) + phases.embedded_target_problems())
    results = phases.Results(args.out, phases.host_record(__file__))
    target = args.tokenizer or phases.make_embedded_target(results, args.log)
    if target is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target)
        for turns in ("first", "multi", "each"):
            results.inline(turns, prompt_tokens, turns, tokenizer, args.max_prompts)
    print(json.dumps(results.data, indent=1))
    sys.exit(results.finish())


if __name__ == "__main__":
    main()
