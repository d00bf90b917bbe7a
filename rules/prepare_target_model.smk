rule prepare_target_model:
    output:
        directory(BUILTIN_TARGET_DIR),
    params:
        dtype=config["target"]["dtype"],
    log:
        "logs/prepare_target_model.log",
    benchmark:
        "benchmarks/prepare_target_model.tsv"
    threads: THREADS
    script:
        "../workflow_scripts/prepare_target_model.py"
