"""Rule write_manifest: results/<run>/manifest.json, every artifact linked to what made it (eagle3_pipeline.lineage)."""

import logging

from eagle3_pipeline.layout import RunLayout
from eagle3_pipeline.lineage import build_manifest, write_manifest
from eagle3_pipeline.runtime import start_log

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 (injected by Snakemake)
    start_log(sm.log[0])
    log = logging.getLogger("write_manifest")
    # the run's directory (from the config, not a param: no rerun): artifact keys are relative to it
    m = build_manifest(RunLayout(sm.config["run"]).dir, list(sm.params.jobs), dict(sm.config), sm.input.target)
    write_manifest(sm.output[0], m)
    failed = [c for c in m["checks"] if not c["ok"]]
    log.info(
        "%d artifacts, %d external inputs; drafter %s…, target fingerprint %s…, tau %s; checks: %d of %d passed",
        len(m["artifacts"]),
        len(m["external"]),
        m["identity"]["drafter"]["sha256"][:12],
        m["identity"]["target"]["fingerprint"][:12],
        m["identity"]["evaluation"]["acceptance_length"],
        len(m["checks"]) - len(failed),
        len(m["checks"]),
    )
    for c in failed:
        log.warning("check %s failed: %s", c["check"], c["detail"])
