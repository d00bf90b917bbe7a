rule train_drafter:
    input:
        shards=get_hidden_state_shards,
        d2t=f"results/{RUN}/vocab/d2t.npy",
        t2d=f"results/{RUN}/vocab/t2d.npy",
        target=get_target_dir(),
    output:
        drafter=directory(f"results/{RUN}/drafter"),
        metrics=f"results/{RUN}/train/metrics.jsonl",
        summary=f"results/{RUN}/train/summary.json",
    log:
        f"logs/{RUN}/train_drafter.log",
    benchmark:
        f"{BENCH}/{BENCHMARKS['train_drafter']}"
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
