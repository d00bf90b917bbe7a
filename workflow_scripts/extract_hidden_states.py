"""Rule extract_hidden_states: prefill one trace shard through the target, store hidden states (resumable)."""

import logging

import torch

from eagle3_pipeline.config import runtime_settings
from eagle3_pipeline.hidden_states import run_extraction_shard
from eagle3_pipeline.runtime import peak_rss_bytes, start_log

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 (injected by Snakemake)
    start_log(sm.log[0])
    torch.set_num_threads(sm.threads)
    index = run_extraction_shard(
        sm.input.traces,
        sm.output.shard,
        sm.output.index,
        sm.input.target,
        # runtime settings (replicas, GPUs per replica, chunk size, disk preflight) come from the
        # config, not params: changing them reruns nothing (config/schema.yaml: x-result: false)
        {
            **sm.params.extraction,
            **runtime_settings(sm.config, "extraction"),
            "replicas_per_gpu": sm.config["vllm"]["replicas_per_gpu"],
        },
        max_seq_len=sm.params.max_seq_len,
        trust_remote_code=sm.params.trust_remote_code,
        host_lock_enabled=sm.config["resources"]["host_lock"],  # config, not a param: no rerun when it changes
    )
    logging.getLogger("extract_hidden_states").info(
        "extracted %d samples, %d tokens, layers %s: %.0f tok/s, model load %.1f s, %.1f MB written, peak RSS %.0f MB, %d of %d chunks resumed",
        index["num_samples"],
        index["num_tokens"],
        index["layer_ids"],
        index["tokens_per_second"],
        index["model_load_seconds"],
        index["bytes"] / 1e6,
        peak_rss_bytes() / 1e6,
        index["chunks_resumed"],
        index["chunks"],
    )
