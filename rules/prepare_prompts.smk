rule prepare_prompts:
    output:
        shards=expand(f"results/{RUN}/prompts/shard-{{shard}}.jsonl", shard=SHARDS),
        rejects=f"results/{RUN}/prompts/rejects.jsonl",
        summary=f"results/{RUN}/prompts/summary.json",
    log:
        f"logs/{RUN}/prepare_prompts.log",
    conda:
        "../envs/cpu.yaml"
    params:
        prompts=config["prompts"],
        sources_digest=get_prompt_sources_digest(),
        eval_prompts=config["evaluation"]["prompts"],
    script:
        "../workflow_scripts/prepare_prompts.py"


rule prepare_eval_prompts:
    output:
        f"results/{RUN}/eval/prompts.jsonl",
    log:
        f"logs/{RUN}/prepare_eval_prompts.log",
    conda:
        "../envs/cpu.yaml"
    params:
        source=config["evaluation"]["prompts"],
        source_digest=get_eval_sources_digest(),
        max_prompts=config["evaluation"]["max_prompts"],
    script:
        "../workflow_scripts/prepare_eval_prompts.py"
