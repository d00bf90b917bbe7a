"""Rule plan: dry-run the default target with this config and write the plan of the jobs it would
run to results/<run>/plan.json (a preview), printed on the terminal and in the log, with the
run-start check of the target (``refused_at_start``: its message, or null). Where the run would be
refused at its start, the job fails after writing both (``snakemake plan`` exits non-zero), so a
script or a user that goes on to start the run stops here."""

import logging
import sys
from pathlib import Path

from eagle3_pipeline.io import write_json_atomic
from eagle3_pipeline.plan import format_plan, plan_dict, plan_run
from eagle3_pipeline.runtime import start_log
from eagle3_pipeline.snakemake_adapter import dry_run_jobs, problem_at_start

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 (injected by Snakemake)
    # the jobs `snakemake -n` would run (changed parameters and code included), before start_log
    # redirects stderr: a workflow that cannot be dry-run fails here with Snakemake's message
    jobs = dry_run_jobs(sm.params.snakefile, Path.cwd(), dict(sm.config))
    stages, platform = plan_run(sm.config, sm.params.target_dir, sm.params.run_dir, jobs, bench_dir=sm.params.bench_dir)
    table = format_plan(stages, jobs)
    print(f"plan for run {sm.config['run']!r} on {platform}:\n{table}", file=sys.stderr, flush=True)  # the terminal
    # the run's start checks the target before any job: a plan says so now, not after the user starts it
    if refused := problem_at_start(jobs, sm.config, sm.params.user_target_dir):
        print(
            f"\nA run with this config would stop at its start, before any job:\n{refused}\n"
            f"(the plan is written to {sm.params.plan_json}; `snakemake plan` exits with status 1)",
            file=sys.stderr,
            flush=True,
        )
    start_log(sm.log[0])
    write_json_atomic(sm.params.plan_json, plan_dict(stages, platform, jobs, kind="preview") | {"refused_at_start": refused})
    logging.getLogger("plan").info("plan for run %r on %s:\n%s", sm.config["run"], platform, table)
    if refused:
        logging.getLogger("plan").error("a run with this config would stop at its start: %s", refused)
        sys.exit(1)
