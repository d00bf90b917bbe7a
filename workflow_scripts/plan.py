"""Rule plan: write results/<run>/plan.json and print the plan (work, time, disk per stage)."""

import logging
import sys

from eagle3_pipeline.io import write_json_atomic
from eagle3_pipeline.plan import format_plan, plan_dict, plan_run
from eagle3_pipeline.runtime import start_log

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 (injected by Snakemake)
    stages, platform = plan_run(sm.config, sm.params.target_dir, sm.params.run_dir)
    table = format_plan(stages)
    print(f"plan for run {sm.config['run']!r} on {platform}:\n{table}", file=sys.stderr, flush=True)  # the terminal
    start_log(sm.log[0])
    write_json_atomic(sm.params.plan_json, plan_dict(stages, platform))
    logging.getLogger("plan").info("plan for run %r on %s:\n%s", sm.config["run"], platform, table)
