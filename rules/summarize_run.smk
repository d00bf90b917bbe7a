rule summarize_run:
    input:
        prompts="results/{run}/prompts/summary.json",
        traces=get_trace_summaries,
        coverage="results/{run}/vocab/coverage.json",
        hidden_indexes=get_hidden_state_indexes,
        train="results/{run}/train/summary.json",
        acceptance="results/{run}/eval/acceptance.json",
    output:
        "results/{run}/summary.json",
    log:
        "logs/{run}/summarize_run.log",
    conda:
        "../envs/cpu.yaml"
    script:
        "../workflow_scripts/summarize_run.py"
