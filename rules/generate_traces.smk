rule generate_traces:
    input:
        prompts=get_prompt_shard,
        target=get_target_dir(),
    output:
        traces=f"results/{RUN}/traces/shard-{{shard}}.jsonl",
        rejects=f"results/{RUN}/traces/shard-{{shard}}.rejects.jsonl",
        summary=f"results/{RUN}/traces/shard-{{shard}}.summary.json",
    log:
        f"logs/{RUN}/generate_traces/shard-{{shard}}.log",
    benchmark:
        f"{BENCH}/{BENCHMARKS['generate_traces']}"
    conda:
        "../envs/cpu.yaml"
    threads: THREADS
    resources:
        gpu=GENERATION_GPUS,
        full_model=1,
    params:
        trust_remote_code=config["target"]["trust_remote_code"],
        target_identity=get_target_identity(),
        generation=GENERATION_PARAMS,
        vllm=VLLM_PARAMS,
        seed=config["seed"],
        max_seq_len=config["max_seq_len"],
    script:
        "../workflow_scripts/generate_traces.py"
