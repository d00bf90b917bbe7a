rule evaluate_drafter:
    input:
        drafter=layout.drafter(),
        prompts=layout.eval_prompts(),
        train_summary=layout.train_summary(),
        target=get_target_dir(),
    output:
        acceptance=layout.acceptance(),
        outputs=layout.eval_outputs(),
        rejects=layout.eval_rejects(),
    log:
        layout.log("evaluate_drafter"),
    benchmark:
        layout.benchmark("evaluate_drafter")
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
        num_speculative_tokens=settings.num_speculative_tokens(config),
        generation=GENERATION_PARAMS,
        vllm=settings.evaluation_vllm(config, VLLM_PARAMS),
        seed=config["seed"],
        max_seq_len=config["max_seq_len"],
    script:
        "../workflow_scripts/evaluate_drafter.py"
