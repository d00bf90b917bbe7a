# The run's figures for `snakemake --report report.html` (captions in report/).
rule plot_run:
    input:
        traces=TRACE_SHARDS,
        token_freq=layout.vocab("token_freq"),
        coverage=layout.coverage(),
        metrics=layout.train_metrics(),
        acceptance=layout.acceptance(),
        summary=layout.summary(),
    output:
        lengths=report(
            layout.plot("lengths"),
            caption="../report/lengths.rst",
            category="1. Traces",
            labels={"figure": "prompt and completion lengths"},
        ),
        generation=report(
            layout.plot("generation"),
            caption="../report/generation.rst",
            category="1. Traces",
            labels={"figure": "generation outcomes and reasoning capture"},
        ),
        rejects=report(
            layout.plot("rejects"),
            caption="../report/rejects.rst",
            category="1. Traces",
            labels={"figure": "rejected records and errors"},
        ),
        vocab_coverage=report(
            layout.plot("vocab_coverage"),
            caption="../report/vocab_coverage.rst",
            category="2. Draft vocabulary",
            labels={"figure": "coverage vs draft vocab size"},
        ),
        training_loss=report(
            layout.plot("training_loss"),
            caption="../report/training_loss.rst",
            category="3. Training",
            labels={"figure": "loss per step"},
        ),
        training_accuracy=report(
            layout.plot("training_accuracy"),
            caption="../report/training_accuracy.rst",
            category="3. Training",
            labels={"figure": "per-position accuracy per step"},
        ),
        acceptance=report(
            layout.plot("acceptance"),
            caption="../report/acceptance.rst",
            category="4. Evaluation",
            labels={"figure": "acceptance length in vLLM"},
        ),
        speedup=report(
            layout.plot("speedup"),
            caption="../report/speedup.rst",
            category="4. Evaluation",
            labels={"figure": "speedup: tokens/s with and without the drafter"},
        ),
        throughput=report(
            layout.plot("throughput"),
            caption="../report/throughput.rst",
            category="5. Run time",
            labels={"figure": "stage throughput"},
        ),
        estimate_vs_actual=report(
            layout.plot("estimate_vs_actual"),
            caption="../report/estimate_vs_actual.rst",
            category="5. Run time",
            labels={"figure": "estimated vs actual time"},
        ),
    log:
        layout.log("plot_run"),
    conda:
        "../envs/cpu.yaml"
    params:
        max_tokens=config["generation"]["max_tokens"],
    script:
        "../workflow_scripts/plot_run.py"
