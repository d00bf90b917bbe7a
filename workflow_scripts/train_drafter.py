"""Rule train_drafter: train speculators' Eagle3DraftModel from the hidden-state shards."""

import logging
from pathlib import Path

import torch

from eagle3_pipeline.io import write_json_atomic
from eagle3_pipeline.runtime import peak_memory, start_log
from eagle3_pipeline.training import run_training

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 (injected by Snakemake)
    start_log(sm.log[0])
    torch.set_num_threads(sm.threads)
    summary = run_training(
        {
            "shards": list(sm.input.shards),
            "vocab_dir": str(Path(sm.input.d2t).parent),
            "target_path": str(Path(sm.input.target).resolve()),
            "out_dir": sm.output.drafter,
            "metrics_path": sm.output.metrics,
            # loader_workers is config, not a param: no rerun when it changes
            "cfg": sm.params.training | {"loader_workers": sm.config["training"]["loader_workers"]},
            "seed": sm.params.seed,
            "max_seq_len": sm.params.max_seq_len,
            "trust_remote_code": sm.params.trust_remote_code,
        },
        sm.params.train_processes,
    )
    write_json_atomic(sm.output.summary, summary | peak_memory())
    logging.getLogger("train_drafter").info("training: %s", summary)
