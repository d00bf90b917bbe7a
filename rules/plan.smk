# `snakemake plan`: no output file, so it runs whenever it is asked for (results/<run>/plan.json
# is rewritten each time; onstart prints the same table before every run).
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
    script:
        "../workflow_scripts/plan.py"
