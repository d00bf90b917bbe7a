# The run's figures for `snakemake --report report.html` (captions in report/).
from eagle3_pipeline.figures import FIGURES


rule plot_run:
    input:
        traces=TRACE_SHARDS,
        token_freq=layout.vocab("token_freq"),
        coverage=layout.coverage(),
        metrics=layout.train_metrics(),
        acceptance=layout.acceptance(),
        summary=layout.summary(),
    output:
        # one figure each of figures.FIGURES, with its caption (report/<name>.rst) and category
        **{
            name: report(
                layout.plot(name),
                caption=f"../report/{name}.rst",
                category=f.category,
                labels={"figure": f.label},
            )
            for name, f in FIGURES.items()
        },
    log:
        layout.log("plot_run"),
    conda:
        "../envs/cpu.yaml"
    params:
        max_tokens=config["generation"]["max_tokens"],
    script:
        "../workflow_scripts/plot_run.py"
