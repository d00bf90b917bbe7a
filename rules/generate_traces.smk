rule generate_traces:
    input:
        prompts=layout.prompt_shard("{shard}"),
        target=get_target_dir(),
    output:
        traces=layout.traces("{shard}"),
        rejects=layout.trace_rejects("{shard}"),
        summary=layout.trace_summary("{shard}"),
    log:
        layout.log("generate_traces", "{shard}"),
    benchmark:
        layout.benchmark("generate_traces", "{shard}")
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
