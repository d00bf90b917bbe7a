rule build_vocab_mapping:
    input:
        traces=get_trace_shards,
        target=get_target_dir(),
    output:
        d2t="results/{run}/vocab/d2t.npy",
        t2d="results/{run}/vocab/t2d.npy",
        token_freq="results/{run}/vocab/token_freq.npy",
        coverage="results/{run}/vocab/coverage.json",
    params:
        draft_vocab_size=config["vocab"]["draft_vocab_size"],
    log:
        "logs/{run}/build_vocab_mapping.log",
    script:
        "../workflow_scripts/build_vocab_mapping.py"
