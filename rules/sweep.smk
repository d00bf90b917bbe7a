# Drafter variants of the run (config sweep.variants): the vocab, training and evaluation
# rules again, on the run's traces and hidden states, with each variant's settings; outputs
# under results/<run>/sweep/<variant>/. Library: workflow_scripts/eagle3_pipeline/sweep.py.
# Each variant's files: the run's layout rooted at sweep/<variant>/ (layout.variant).
VARIANT = layout.variant("{variant}")
# The sweep table's drafters, the run's own first (eagle3_pipeline.sweep.sweep_rows).
SWEEP_ROWS = sweep.sweep_rows(config, VARIANTS, layout)


use rule build_vocab_mapping as build_vocab_mapping_variant with:
    output:
        d2t=VARIANT.vocab("d2t"),
        t2d=VARIANT.vocab("t2d"),
        token_freq=VARIANT.vocab("token_freq"),
        coverage=VARIANT.coverage(),
    log:
        VARIANT.log("build_vocab_mapping"),
    params:  # each param not named here is the run rule's (Snakemake merges keyword params)
        draft_vocab_size=lambda w: VARIANTS[w.variant]["vocab"]["draft_vocab_size"],
        init_from=lambda w: VARIANTS[w.variant]["training"]["init_from"],
        init_identity=lambda w: get_init_drafter_identity(VARIANTS[w.variant]),


use rule train_drafter as train_drafter_variant with:
    input:
        unpack(get_variant_vocab),
        shards=HIDDEN_STATE_SHARDS,
        target=get_target_dir(),
    output:
        drafter=directory(VARIANT.drafter()),
        metrics=VARIANT.train_metrics(),
        summary=VARIANT.train_summary(),
    log:
        VARIANT.log("train_drafter"),
    benchmark:
        VARIANT.benchmark("train_drafter")
    priority: VARIANT_TRAIN_PRIORITY
    params:  # each param not named here is the run rule's
        training=lambda w: settings.result_settings(VARIANTS[w.variant], "training"),
        init_identity=lambda w: get_init_drafter_identity(VARIANTS[w.variant]),


use rule evaluate_drafter as evaluate_drafter_variant with:
    input:
        unpack(get_variant_drafter),
        prompts=layout.eval_prompts(),
        target=get_target_dir(),
    output:
        acceptance=VARIANT.acceptance(),
        outputs=VARIANT.eval_outputs(),
        rejects=VARIANT.eval_rejects(),
    log:
        VARIANT.log("evaluate_drafter"),
    benchmark:
        VARIANT.benchmark("evaluate_drafter")
    priority: VARIANT_EVAL_PRIORITY
    params:  # each param not named here is the run rule's
        evaluation=lambda w: VARIANTS[w.variant]["evaluation"],
        num_speculative_tokens=lambda w: settings.num_speculative_tokens(
            VARIANTS[w.variant]
        ),
        vllm=lambda w: settings.evaluation_vllm(VARIANTS[w.variant], VLLM_PARAMS),


# One table of tau and training cost: the run's drafter and every variant's.
rule sweep_table:
    input:
        acceptance=[r["acceptance"] for r in SWEEP_ROWS],
        train_summary=[r["train_summary"] for r in SWEEP_ROWS],
        coverage=[r["coverage"] for r in SWEEP_ROWS],
    output:
        json=layout.sweep_json(),
        table=layout.sweep_table(),
    log:
        layout.log("sweep_table"),
    conda:
        "../envs/cpu.yaml"
    params:
        rows=[{k: r[k] for k in ("name", "changes", "shared")} for r in SWEEP_ROWS],
    script:
        "../workflow_scripts/sweep_table.py"
