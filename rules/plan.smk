# `snakemake plan`: no output file, so it runs whenever it is asked for. It dry-runs the default
# target with this config and writes the preview to results/<run>/plan.json; a real run keeps
# its own start plan under results/<run>/plans/ (onstart).
rule plan:
    log:
        f"logs/{RUN}/plan.log",
    localrule: True
    conda:
        "../envs/cpu.yaml"
    params:
        target_dir=get_target_dir(),
        run_dir=f"results/{RUN}",
        plan_json=f"results/{RUN}/plan.json",
        snakefile=workflow.main_snakefile,
    script:
        "../workflow_scripts/plan.py"
