"""Rule summarize_run: one summary.json with every stage's counts, rejects and results."""

import logging

from eagle3_pipeline.io import write_json_atomic
from eagle3_pipeline.layout import RunLayout
from eagle3_pipeline.plan import estimate_vs_actual, measured
from eagle3_pipeline.runtime import start_log
from eagle3_pipeline.summary import summarize

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 (injected by Snakemake)
    start_log(sm.log[0])
    s = summarize(
        sm.input.prompts, list(sm.input.traces), sm.input.coverage, list(sm.input.hidden_indexes), sm.input.train, sm.input.acceptance
    )
    layout = RunLayout(sm.config["run"])  # the run's files (from the config, not a param: no rerun)
    # each full-model/training stage's tokens/s and model load seconds, as its outputs recorded them
    s["throughput"] = measured(layout.dir)
    # the plans the run started with (one per start or resume), against what happened
    s["estimate_vs_actual"] = estimate_vs_actual(layout.start_plans(), layout.dir, layout.bench_dir)
    write_json_atomic(sm.output[0], s)
    log = logging.getLogger("summarize_run")
    log.info("prompts: %d kept of %d read, rejects %s", s["prompts"]["kept"], s["prompts"]["read"], s["prompts"]["rejects_by_reason"])
    log.info(
        "generation: %d ok, %d truncated, rejects %s",
        s["generation"]["ok"],
        s["generation"]["truncated"],
        s["generation"]["rejects_by_reason"],
    )
    log.info("acceptance length tau = %.3f", s["evaluation"]["acceptance_length"])
    for r in s["estimate_vs_actual"]:
        log.info("%-22s estimated %8.1f s, took %s s (%s)", r["stage"], r["estimated_seconds"], r["actual_seconds"], r["source"])
