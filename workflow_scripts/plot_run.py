"""Rule plot_run: the run's figures for `snakemake --report` (results/<run>/plots/*.png)."""

import logging

from eagle3_pipeline.report import FIGURES, make_plots
from eagle3_pipeline.runtime import start_log

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 (injected by Snakemake)
    start_log(sm.log[0])
    make_plots(
        list(sm.input.traces),
        sm.input.token_freq,
        sm.input.coverage,
        sm.input.metrics,
        sm.input.acceptance,
        sm.input.summary,
        {name: sm.output[name] for name in FIGURES},
        max_tokens=sm.params.max_tokens,
    )
    logging.getLogger("plot_run").info("wrote %d figures: %s", len(FIGURES), ", ".join(sm.output))
