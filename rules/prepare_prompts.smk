rule prepare_prompts:
    output:
        shards=[layout.prompt_shard(s) for s in SHARDS],
        rejects=layout.prompt_rejects(),
        summary=layout.prompt_summary(),
    log:
        layout.log("prepare_prompts"),
    conda:
        "../envs/cpu.yaml"
    params:
        prompts=config["prompts"],
        sources_digest=get_sources_digest(prompt_source_groups(config)),
        eval_prompts=config["evaluation"]["prompts"],
    script:
        "../workflow_scripts/prepare_prompts.py"


rule prepare_eval_prompts:
    output:
        layout.eval_prompts(),
    log:
        layout.log("prepare_eval_prompts"),
    conda:
        "../envs/cpu.yaml"
    params:
        source=config["evaluation"]["prompts"],
        source_digest=get_sources_digest(
            {"evaluation.prompts": [config["evaluation"]["prompts"]]}
        ),
        max_prompts=config["evaluation"]["max_prompts"],
    script:
        "../workflow_scripts/prepare_eval_prompts.py"
