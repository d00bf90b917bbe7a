# `snakemake plan`: no output file, so it runs whenever it is asked for. It dry-runs the default
# target with this config and writes the preview to results/<run>/plan.json; a real run keeps
# its own start plan under results/<run>/plans/ (onstart).
rule plan:
    log:
        layout.log("plan"),
    localrule: True
    conda:
        "../envs/cpu.yaml"
    params:
        target_dir=get_target_dir(),
        run_dir=layout.dir,
        plan_json=layout.plan_preview(),
        snakefile=workflow.main_snakefile,
    script:
        "../workflow_scripts/plan.py"
