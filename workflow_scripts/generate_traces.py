"""Rule generate_traces: regenerate responses to one prompt shard with the target under vLLM (resumable)."""

from eagle3_pipeline.config import runtime_settings
from eagle3_pipeline.generation import run_generation_shard
from eagle3_pipeline.runtime import start_log

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 (injected by Snakemake)
    start_log(sm.log[0])
    p = sm.params
    run_generation_shard(
        sm.input.prompts,
        {"traces": sm.output.traces, "rejects": sm.output.rejects, "summary": sm.output.summary},
        sm.input.target,
        {
            # runtime settings (data-parallel layout, chunk size) are read from the config, not
            # params: changing them reruns nothing (config/schema.yaml: x-result: false)
            "generation": {**p.generation, **runtime_settings(sm.config, "generation")},
            "vllm": {**p.vllm, **runtime_settings(sm.config, "vllm")},
            "seed": p.seed,
            "max_seq_len": p.max_seq_len,
            "trust_remote_code": p.trust_remote_code,
        },
        chunk_prompts=sm.config["generation"]["chunk_prompts"],
        host_lock_enabled=sm.config["resources"]["host_lock"],  # config, not a param: no rerun when it changes
    )
