rule verify:
    log:
        f"logs/{RUN}/verify.log",
    conda:
        "../envs/cpu.yaml"
    params:
        traces=expand(f"results/{RUN}/traces/shard-{{shard}}.jsonl", shard=SHARDS),
        hidden_states=expand(
            f"results/{RUN}/hidden_states/shard-{{shard}}.safetensors",
            shard=SHARDS,
        ),
        manifest=f"results/{RUN}/manifest.json",
    script:
        "../workflow_scripts/verify.py"
