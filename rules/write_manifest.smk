# The run manifest: every artifact with its hash, the job that made it and that job's inputs,
# plus the run's identity (target, engine and libraries, sampling, prompts, vocab, layers,
# training config, drafter, tau). Library: workflow_scripts/eagle3_pipeline/lineage.py; the jobs
# and their files come from the rules themselves (get_lineage_jobs: snakemake_adapter.lineage_jobs).
rule write_manifest:
    input:
        artifacts=get_lineage_outputs,
        target=get_target_dir(),
    output:
        layout.manifest(),
    log:
        layout.log("write_manifest"),
    conda:
        "../envs/cpu.yaml"
    params:
        jobs=get_lineage_jobs,
    script:
        "../workflow_scripts/write_manifest.py"
