rule summarize_run:
    input:
        prompts=f"results/{RUN}/prompts/summary.json",
        traces=get_trace_summaries,
        coverage=f"results/{RUN}/vocab/coverage.json",
        hidden_indexes=get_hidden_state_indexes,
        train=f"results/{RUN}/train/summary.json",
        acceptance=f"results/{RUN}/eval/acceptance.json",
    output:
        f"results/{RUN}/summary.json",
    log:
        f"logs/{RUN}/summarize_run.log",
    conda:
        "../envs/cpu.yaml"
    script:
        "../workflow_scripts/summarize_run.py"
