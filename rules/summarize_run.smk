rule summarize_run:
    input:
        prompts=layout.prompt_summary(),
        traces=TRACE_SUMMARIES,
        coverage=layout.coverage(),
        hidden_indexes=HIDDEN_STATE_INDEXES,
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
