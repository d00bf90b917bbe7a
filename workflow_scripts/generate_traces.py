"""Rule generate_traces: regenerate responses to one prompt shard with the target under vLLM."""

import logging

from eagle3_pipeline.engine import build_llm, engine_identity
from eagle3_pipeline.generation import generate_shard
from eagle3_pipeline.io import read_jsonl, write_json_atomic, write_jsonl_atomic
from eagle3_pipeline.runtime import Timer, start_log
from eagle3_pipeline.target_model import load_tokenizer, model_fingerprint

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 (injected by Snakemake)
    start_log(sm.log[0])
    log = logging.getLogger("generate_traces")
    records = list(read_jsonl(sm.input.prompts))
    target = sm.input.target
    model = {"path": target, "fingerprint": model_fingerprint(target)}
    load = Timer()
    llm = build_llm(
        target, sm.params.vllm, seed=sm.params.seed, max_model_len=sm.params.max_seq_len, trust_remote_code=sm.params.trust_remote_code
    )
    load_s = load.seconds
    gen = Timer()
    res = generate_shard(
        llm,
        load_tokenizer(target, sm.params.trust_remote_code),
        records,
        sm.params.generation,
        max_seq_len=sm.params.max_seq_len,
        seed=sm.params.seed,
        engine=engine_identity(),
        model=model,
    )
    gen_s = gen.seconds
    summary = res.summary() | {
        "model_load_seconds": round(load_s, 3),
        "generate_seconds": round(gen_s, 3),
        "completion_tokens_per_second": res.counts["completion_tokens"] / gen_s if gen_s else 0.0,
    }
    write_jsonl_atomic(sm.output.rejects, (r.as_dict() for r in res.rejects))
    write_jsonl_atomic(sm.output.traces, res.traces)
    write_json_atomic(sm.output.summary, summary)
    log.info("generation: %s", summary)
