rule train_drafter:
    input:
        shards=HIDDEN_STATE_SHARDS,
        d2t=layout.vocab("d2t"),
        t2d=layout.vocab("t2d"),
        target=get_target_dir(),
    output:
        drafter=directory(layout.drafter()),
        metrics=layout.train_metrics(),
        summary=layout.train_summary(),
    log:
        layout.log("train_drafter"),
    benchmark:
        layout.benchmark("train_drafter")
    priority: RUN_PRIORITY
    conda:
        "../envs/cpu.yaml"
    threads: THREADS
    resources:
        gpu=config["resources"]["train_gpus"],
        full_model=TRAIN_FULL_MODEL,
    params:
        trust_remote_code=config["target"]["trust_remote_code"],
        training=TRAINING_PARAMS,
        init_identity=get_init_drafter_identity(),
        train_processes=TRAIN_PROCESSES,
        seed=config["seed"],
        max_seq_len=config["max_seq_len"],
    script:
        "../workflow_scripts/train_drafter.py"
