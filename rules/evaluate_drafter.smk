rule evaluate_drafter:
    input:
        drafter=f"results/{RUN}/drafter",
        prompts=f"results/{RUN}/eval/prompts.jsonl",
        train_summary=f"results/{RUN}/train/summary.json",
        target=get_target_dir(),
    output:
        acceptance=f"results/{RUN}/eval/acceptance.json",
        outputs=f"results/{RUN}/eval/outputs.jsonl",
        rejects=f"results/{RUN}/eval/rejects.jsonl",
    log:
        f"logs/{RUN}/evaluate_drafter.log",
    benchmark:
        f"{BENCH}/{BENCHMARKS['evaluate_drafter']}"
    priority: RUN_PRIORITY
    conda:
        "../envs/cpu.yaml"
    threads: THREADS
    resources:
        gpu=EVALUATION_GPUS,
        full_model=1,
    params:
        trust_remote_code=config["target"]["trust_remote_code"],
        evaluation=config["evaluation"],
        num_speculative_tokens=get_num_speculative_tokens(),
        generation=GENERATION_PARAMS,
        vllm=eval_vllm_params(),
        seed=config["seed"],
        max_seq_len=config["max_seq_len"],
    script:
        "../workflow_scripts/evaluate_drafter.py"
