rule verify:
    log:
        layout.log("verify"),
    conda:
        "../envs/cpu.yaml"
    params:
        traces=TRACE_SHARDS,
        hidden_states=HIDDEN_STATE_SHARDS,
        manifest=layout.manifest(),
    script:
        "../workflow_scripts/verify.py"
