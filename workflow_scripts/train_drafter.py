"""Rule train_drafter: train speculators' Eagle3DraftModel from the hidden-state shards."""

import logging
from pathlib import Path

import torch

from eagle3_pipeline.config import runtime_settings
from eagle3_pipeline.hygiene import host_lock, output_lock
from eagle3_pipeline.io import write_json_atomic
from eagle3_pipeline.runtime import peak_memory, start_log
from eagle3_pipeline.training import run_training

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 (injected by Snakemake)
    start_log(sm.log[0])
    torch.set_num_threads(sm.threads)
    # in a sweep, trainings take the full-model lock (rules/common.smk: TRAIN_FULL_MODEL), and the
    # host-wide one with it, so that no evaluation of another snakemake on this host shares the GPU
    lock = sm.config["resources"]["host_lock"] and int(sm.resources.get("full_model", 0)) > 0
    # the job of a snakemake killed alone lives on: this one waits for it, then keeps what it
    # finished (summary_path) or resumes from its checkpoint
    with output_lock(sm.output.summary), host_lock(enabled=lock):
        summary = run_training(
            {
                "shards": list(sm.input.shards),
                "vocab_dir": str(Path(sm.input.d2t).parent),
                "target_path": str(Path(sm.input.target).resolve()),
                "out_dir": sm.output.drafter,
                "metrics_path": sm.output.metrics,
                # runtime settings (loader workers, checkpoint interval) are config, not params: no rerun
                "cfg": sm.params.training | runtime_settings(sm.config, "training"),
                "seed": sm.params.seed,
                "max_seq_len": sm.params.max_seq_len,
                "trust_remote_code": sm.params.trust_remote_code,
                "summary_path": sm.output.summary,
            },
            sm.params.train_processes,
        )
        # a summary kept from the job that finished these outputs keeps that job's peak memory
        write_json_atomic(sm.output.summary, peak_memory() | summary)
    logging.getLogger("train_drafter").info("training: %s", summary)
