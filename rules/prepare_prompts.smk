rule prepare_prompts:
    output:
        shards=expand("results/{{run}}/prompts/shard-{shard}.jsonl", shard=SHARDS),
        rejects="results/{run}/prompts/rejects.jsonl",
        summary="results/{run}/prompts/summary.json",
    params:
        prompts=config["prompts"],
        eval_prompts=config["evaluation"]["prompts"],
    log:
        "logs/{run}/prepare_prompts.log",
    script:
        "../workflow_scripts/prepare_prompts.py"


rule prepare_eval_prompts:
    output:
        "results/{run}/eval/prompts.jsonl",
    params:
        source=config["evaluation"]["prompts"],
        max_prompts=config["evaluation"]["max_prompts"],
    log:
        "logs/{run}/prepare_eval_prompts.log",
    script:
        "../workflow_scripts/prepare_eval_prompts.py"
