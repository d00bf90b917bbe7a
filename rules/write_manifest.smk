# The run manifest: every artifact with its hash, the job that made it and that job's inputs,
# plus the run's identity (target, engine and libraries, sampling, prompts, vocab, layers,
# training config, drafter, tau). Library: workflow_scripts/eagle3_pipeline/lineage.py; the jobs
# and their files come from the rules themselves (get_lineage_jobs: snakemake_adapter.lineage_jobs);
# its inputs are the outputs no job reads (lineage.lineage_terminals), which come after every job.
rule write_manifest:
    input:
        artifacts=get_lineage_terminals,
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
