rule evaluate_drafter:
    input:
        drafter="results/{run}/drafter",
        prompts="results/{run}/eval/prompts.jsonl",
        train_summary="results/{run}/train/summary.json",
        target=get_target_dir(),
    output:
        acceptance="results/{run}/eval/acceptance.json",
        outputs="results/{run}/eval/outputs.jsonl",
    params:
        evaluation=config["evaluation"],
        num_speculative_tokens=get_num_speculative_tokens(),
        generation=config["generation"],
        vllm=config["vllm"],
        seed=config["seed"],
        max_seq_len=config["max_seq_len"],
    resources:
        gpu=FULL_MODEL_GPUS,
        full_model=1,
    threads: THREADS
    log:
        "logs/{run}/evaluate_drafter.log",
    benchmark:
        "benchmarks/{run}/evaluate_drafter.tsv"
    script:
        "../workflow_scripts/evaluate_drafter.py"
