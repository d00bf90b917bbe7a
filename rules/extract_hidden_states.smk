rule extract_hidden_states:
    input:
        traces=get_trace_shard,
        target=get_target_dir(),
    output:
        shard="results/{run}/hidden_states/shard-{shard}.safetensors",
        index="results/{run}/hidden_states/shard-{shard}.index.json",
    log:
        "logs/{run}/extract_hidden_states/shard-{shard}.log",
    benchmark:
        "benchmarks/{run}/extract_hidden_states/shard-{shard}.tsv"
    conda:
        "../envs/cpu.yaml"
    threads: THREADS
    resources:
        gpu=EXTRACTION_GPUS,
        full_model=1,
    params:
        host_lock=config["resources"]["host_lock"],
        trust_remote_code=config["target"]["trust_remote_code"],
        target_identity=get_target_identity(),
        extraction=config["extraction"],
        max_seq_len=config["max_seq_len"],
    script:
        "../workflow_scripts/extract_hidden_states.py"
