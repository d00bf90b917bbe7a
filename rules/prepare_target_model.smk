rule prepare_target_model:
    output:
        directory(BUILTIN_TARGET_DIR),
    log:
        layout.target_model_log(),
    benchmark:
        layout.target_model_benchmark()
    conda:
        "../envs/cpu.yaml"
    threads: THREADS
    params:
        dtype=config["target"]["dtype"],
    script:
        "../workflow_scripts/prepare_target_model.py"
