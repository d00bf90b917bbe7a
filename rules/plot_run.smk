# The run's figures for `snakemake --report report.html` (captions in report/).
rule plot_run:
    input:
        traces=get_trace_shards,
        token_freq=f"results/{RUN}/vocab/token_freq.npy",
        coverage=f"results/{RUN}/vocab/coverage.json",
        metrics=f"results/{RUN}/train/metrics.jsonl",
        acceptance=f"results/{RUN}/eval/acceptance.json",
        summary=f"results/{RUN}/summary.json",
    output:
        lengths=report(
            f"results/{RUN}/plots/lengths.png",
            caption="../report/lengths.rst",
            category="1. Traces",
            labels={"figure": "prompt and completion lengths"},
        ),
        generation=report(
            f"results/{RUN}/plots/generation.png",
            caption="../report/generation.rst",
            category="1. Traces",
            labels={"figure": "generation outcomes and reasoning capture"},
        ),
        rejects=report(
            f"results/{RUN}/plots/rejects.png",
            caption="../report/rejects.rst",
            category="1. Traces",
            labels={"figure": "rejected records and errors"},
        ),
        vocab_coverage=report(
            f"results/{RUN}/plots/vocab_coverage.png",
            caption="../report/vocab_coverage.rst",
            category="2. Draft vocabulary",
            labels={"figure": "coverage vs draft vocab size"},
        ),
        training_loss=report(
            f"results/{RUN}/plots/training_loss.png",
            caption="../report/training_loss.rst",
            category="3. Training",
            labels={"figure": "loss per step"},
        ),
        training_accuracy=report(
            f"results/{RUN}/plots/training_accuracy.png",
            caption="../report/training_accuracy.rst",
            category="3. Training",
            labels={"figure": "per-position accuracy per step"},
        ),
        acceptance=report(
            f"results/{RUN}/plots/acceptance.png",
            caption="../report/acceptance.rst",
            category="4. Evaluation",
            labels={"figure": "acceptance length in vLLM"},
        ),
        speedup=report(
            f"results/{RUN}/plots/speedup.png",
            caption="../report/speedup.rst",
            category="4. Evaluation",
            labels={"figure": "speedup: tokens/s with and without the drafter"},
        ),
        throughput=report(
            f"results/{RUN}/plots/throughput.png",
            caption="../report/throughput.rst",
            category="5. Run time",
            labels={"figure": "stage throughput"},
        ),
        estimate_vs_actual=report(
            f"results/{RUN}/plots/estimate_vs_actual.png",
            caption="../report/estimate_vs_actual.rst",
            category="5. Run time",
            labels={"figure": "estimated vs actual time"},
        ),
    log:
        f"logs/{RUN}/plot_run.log",
    conda:
        "../envs/cpu.yaml"
    params:
        max_tokens=config["generation"]["max_tokens"],
    script:
        "../workflow_scripts/plot_run.py"
