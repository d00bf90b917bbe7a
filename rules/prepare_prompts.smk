rule prepare_prompts:
    output:
        shards=expand("results/{{run}}/prompts/shard-{shard}.jsonl", shard=SHARDS),
        rejects="results/{run}/prompts/rejects.jsonl",
        summary="results/{run}/prompts/summary.json",
    log:
        "logs/{run}/prepare_prompts.log",
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
        "results/{run}/eval/prompts.jsonl",
    log:
        "logs/{run}/prepare_eval_prompts.log",
    conda:
        "../envs/cpu.yaml"
    params:
        source=config["evaluation"]["prompts"],
        source_digest=get_eval_sources_digest(),
        max_prompts=config["evaluation"]["max_prompts"],
    script:
        "../workflow_scripts/prepare_eval_prompts.py"
