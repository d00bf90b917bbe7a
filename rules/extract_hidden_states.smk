rule extract_hidden_states:
    input:
        traces=rules.generate_traces.output.traces,
        target=get_target_dir(),
    output:
        shard=layout.hidden_states("{shard}"),
        index=layout.hidden_index("{shard}"),
    log:
        layout.log("extract_hidden_states", "{shard}"),
    benchmark:
        layout.benchmark("extract_hidden_states", "{shard}")
    conda:
        "../envs/cpu.yaml"
    threads: THREADS
    resources:
        gpu=EXTRACTION_GPUS,
        full_model=1,
    params:
        trust_remote_code=config["target"]["trust_remote_code"],
        target_identity=get_target_identity(),
        extraction=EXTRACTION_PARAMS,
        max_seq_len=config["max_seq_len"],
    script:
        "../workflow_scripts/extract_hidden_states.py"
