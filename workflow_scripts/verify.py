"""Rule verify: re-check every shard against its manifest and the run's files against the run manifest; fail naming each bad file."""

import logging
import sys

from eagle3_pipeline.runtime import start_log
from eagle3_pipeline.verify import verify_run

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 (injected by Snakemake)
    start_log(sm.log[0])
    log = logging.getLogger("verify")
    res = verify_run(list(sm.params.traces), list(sm.params.hidden_states), sm.params.manifest)
    for p in res["problems"]:
        log.error("%s", p)
    if res["problems"]:
        sys.exit(f"verify: {len(res['problems'])} problem(s):\n" + "\n".join(res["problems"]))
    log.info("verify: all %d shards match their manifests", res["checked"])
    if res["manifest"] == "checked":
        log.info("verify: every file in %s matches", sm.params.manifest)
    else:
        log.info("verify: no run manifest %s yet (written at the end of a run); shards only", sm.params.manifest)
