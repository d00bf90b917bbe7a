rule prepare_target_model:
    output:
        directory(BUILTIN_TARGET_DIR),
    log:
        "logs/prepare_target_model.log",
    benchmark:
        "logs/prepare_target_model.benchmark.tsv"
    conda:
        "../envs/cpu.yaml"
    threads: THREADS
    params:
        dtype=config["target"]["dtype"],
    script:
        "../workflow_scripts/prepare_target_model.py"
