"""Rule verify: re-check every shard against its manifest and the run's files against the run manifest;
print what was checked (console and log), fail naming each bad file."""

import logging
import os
import sys

from eagle3_pipeline.runtime import start_log
from eagle3_pipeline.verify import summary_lines, verify_run

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 (injected by Snakemake)
    console = os.fdopen(os.dup(2), "w", buffering=1)  # the terminal, before start_log sends stderr to the log
    start_log(sm.log[0])
    log = logging.getLogger("verify")
    res = verify_run(list(sm.params.traces), list(sm.params.hidden_states), sm.params.manifest)
    lines = summary_lines(res, sm.params.manifest)
    for line in lines:
        (log.error if res["problems"] else log.info)("%s", line)
        print(line, file=console)
    if res["problems"]:
        sys.exit(1)
