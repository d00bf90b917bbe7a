rule build_vocab_mapping:
    input:
        traces=get_trace_shards,
        target=get_target_dir(),
    output:
        d2t="results/{run}/vocab/d2t.npy",
        t2d="results/{run}/vocab/t2d.npy",
        token_freq="results/{run}/vocab/token_freq.npy",
        coverage="results/{run}/vocab/coverage.json",
    log:
        "logs/{run}/build_vocab_mapping.log",
    conda:
        "../envs/cpu.yaml"
    params:
        trust_remote_code=config["target"]["trust_remote_code"],
        draft_vocab_size=config["vocab"]["draft_vocab_size"],
    script:
        "../workflow_scripts/build_vocab_mapping.py"
