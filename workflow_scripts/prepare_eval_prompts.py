"""Rule prepare_eval_prompts: the held-out evaluation questions (MT-Bench by default)."""

import logging

from eagle3_pipeline.io import write_jsonl_atomic
from eagle3_pipeline.prompts import load_eval_questions
from eagle3_pipeline.runtime import start_log

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 (injected by Snakemake)
    start_log(sm.log[0])
    questions = load_eval_questions(sm.params.source)
    if sm.params.max_prompts is not None:
        questions = questions[: sm.params.max_prompts]
    n = write_jsonl_atomic(sm.output[0], questions)
    logging.getLogger("prepare_eval_prompts").info("%d evaluation questions", n)
