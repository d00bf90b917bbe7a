rule summarize_run:
    input:
        prompts=layout.prompt_summary(),
        traces=get_trace_summaries,
        coverage=layout.coverage(),
        hidden_indexes=get_hidden_state_indexes,
        train=layout.train_summary(),
        acceptance=layout.acceptance(),
    output:
        layout.summary(),
    log:
        layout.log("summarize_run"),
    conda:
        "../envs/cpu.yaml"
    script:
        "../workflow_scripts/summarize_run.py"
