"""Rule evaluate_drafter: acceptance length (tau) of the drafter measured in vLLM."""

from eagle3_pipeline.evaluation import run_evaluation
from eagle3_pipeline.layout import RunLayout
from eagle3_pipeline.runtime import start_log

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 (injected by Snakemake)
    start_log(sm.log[0])
    p = sm.params
    run_evaluation(
        sm.input.drafter,
        sm.input.prompts,
        sm.input.target,
        sm.input.train_summary,
        {"acceptance": sm.output.acceptance, "outputs": sm.output.outputs, "rejects": sm.output.rejects},
        {k: p[k] for k in ("evaluation", "num_speculative_tokens", "generation", "vllm", "seed", "max_seq_len", "trust_remote_code")},
        # the run's layout (config, not a param): its process records, a sweep variant's evaluation's too
        layout=RunLayout(sm.config["run"]),
        variant=getattr(sm.wildcards, "variant", None),
        host_lock_enabled=sm.config["resources"]["host_lock"],  # config, not a param: no rerun when it changes
    )
