rule generate_traces:
    input:
        prompts=get_prompt_shard,
        target=get_target_dir(),
    output:
        traces="results/{run}/traces/shard-{shard}.jsonl",
        rejects="results/{run}/traces/shard-{shard}.rejects.jsonl",
        summary="results/{run}/traces/shard-{shard}.summary.json",
    log:
        "logs/{run}/generate_traces/shard-{shard}.log",
    benchmark:
        "benchmarks/{run}/generate_traces/shard-{shard}.tsv"
    conda:
        "../envs/cpu.yaml"
    threads: THREADS
    resources:
        gpu=GENERATION_GPUS,
        full_model=1,
    params:
        host_lock=config["resources"]["host_lock"],
        trust_remote_code=config["target"]["trust_remote_code"],
        target_identity=get_target_identity(),
        generation=config["generation"],
        vllm=config["vllm"],
        seed=config["seed"],
        max_seq_len=config["max_seq_len"],
    script:
        "../workflow_scripts/generate_traces.py"
