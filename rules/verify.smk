rule verify:
    log:
        f"logs/{RUN}/verify.log",
    conda:
        "../envs/cpu.yaml"
    params:
        traces=expand("results/{run}/traces/shard-{shard}.jsonl", run=RUN, shard=SHARDS),
        hidden_states=expand(
            "results/{run}/hidden_states/shard-{shard}.safetensors",
            run=RUN,
            shard=SHARDS,
        ),
    script:
        "../workflow_scripts/verify.py"
