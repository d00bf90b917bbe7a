"""Rule prepare_prompts: sources -> canonical, deduplicated, decontaminated prompt shards."""

import logging

from eagle3_pipeline.io import write_json_atomic, write_jsonl_atomic
from eagle3_pipeline.prompts import Decontaminator, build_prompt_set, load_eval_questions, split_shards
from eagle3_pipeline.runtime import start_log

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 (injected by Snakemake)
    start_log(sm.log[0])
    cfg = sm.params.prompts
    decon = None
    if cfg["decontaminate"]:
        questions = load_eval_questions(sm.params.eval_prompts)
        decon = Decontaminator((q["id"], t) for q in questions for t in q["turns"])
    ps = build_prompt_set(cfg["sources"], turns=cfg["turns"], max_prompts=cfg["max_prompts"], decontaminator=decon)
    shards = split_shards(ps.records, len(sm.output.shards))
    write_jsonl_atomic(sm.output.rejects, (r.as_dict() for r in ps.rejects))
    for path, recs in zip(sm.output.shards, shards, strict=True):
        write_jsonl_atomic(path, recs)
    summary = ps.summary() | {"shards": [len(s) for s in shards]}
    write_json_atomic(sm.output.summary, summary)
    logging.getLogger("prepare_prompts").info("prompts: %s", summary)
