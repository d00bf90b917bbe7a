# Plans: `snakemake plan` previews a run; a real run keeps the plan it starts with (onstart) and,
# when it stops early, says what a rerun resumes from (onerror). Library: eagle3_pipeline/plan.py,
# the hooks' bodies in eagle3_pipeline/snakemake_adapter.py (the module that reads Snakemake's DAG).
from eagle3_pipeline.snakemake_adapter import on_start, print_resume_hint


onstart:
    on_start(workflow, config, layout, get_user_target_dir())


onerror:
    print_resume_hint(workflow, layout)


# `snakemake plan`: no output file, so it runs whenever it is asked for. It dry-runs the default
# target with this config and writes the preview to results/<run>/plan.json.
rule plan:
    log:
        layout.log("plan"),
    localrule: True
    conda:
        "../envs/cpu.yaml"
    params:
        target_dir=get_target_dir(),
        user_target_dir=get_user_target_dir(),
        run_dir=layout.dir,
        bench_dir=layout.bench_dir,
        plan_json=layout.plan_preview(),
        snakefile=workflow.main_snakefile,
    script:
        "../workflow_scripts/plan.py"
