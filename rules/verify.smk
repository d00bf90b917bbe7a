rule verify:
    log:
        layout.log("verify"),
    conda:
        "../envs/cpu.yaml"
    params:
        traces=[layout.traces(s) for s in SHARDS],
        hidden_states=[layout.hidden_states(s) for s in SHARDS],
        manifest=layout.manifest(),
    script:
        "../workflow_scripts/verify.py"
