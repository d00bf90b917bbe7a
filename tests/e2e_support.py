"""The reduced end-to-end configuration, runner and command line shared by the workflow tests."""

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

#: The embedded default, reduced (.test/config.yaml: 12 prompts in 2 shards, 40-token answers),
#: a configuration a user can run too.
SMALL = yaml.safe_load((ROOT / ".test" / "config.yaml").read_text())
# The local end-to-end run also measures the speedup (a second engine, the target alone): once,
# not in every run of the reduced config.
SMALL_WITH_SPEEDUP = SMALL | {"evaluation": SMALL["evaluation"] | {"speedup": {"concurrency": [4]}}}


#: vLLM's engine core in the job's own process (V1 multiprocessing off) in the workflow runs of the
#: tests: on 2 CPU cores each engine then starts in ~23 s instead of ~45 s (SmolLM2, no process to
#: spawn and import vLLM into twice), and every stage's work is the same. Users' runs keep vLLM's
#: default, an engine process of its own, which test_resume.py and test_vllm_extraction.py start
#: (their jobs find, end and clean up those processes).
IN_PROCESS_ENGINES = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def snakemake_cli(workdir: Path, configfile: Path, *options: str, targets: tuple[str, ...] = (), **run_kw) -> subprocess.CompletedProcess:
    """``python -m snakemake <options> -s Snakefile -d <workdir> --configfile <configfile> [-- <targets>]``,
    the command line a user types, run with its output captured (``run_kw``: more ``subprocess.run`` arguments)."""
    cmd = [sys.executable, "-m", "snakemake", *options, "-s", str(ROOT / "Snakefile"), "-d", str(workdir), "--configfile", str(configfile)]
    if targets:
        cmd += ["--", *targets]  # --configfile takes several values
    run_kw["env"] = {**run_kw.get("env", os.environ), **IN_PROCESS_ENGINES}
    return subprocess.run(cmd, capture_output=True, text=True, **run_kw)


def make_workdir(wd: Path, config: dict = SMALL) -> Path:
    """Prepare ``wd`` as a run directory (the repository's config/ linked in); return its config file."""
    wd.mkdir(parents=True, exist_ok=True)
    (wd / "config").symlink_to(ROOT / "config")
    cfg = wd / "small.yaml"
    cfg.write_text(yaml.safe_dump(config))
    return cfg


def run_api(workdir: Path, configfile: Path, cores: int = 4, resources: dict | None = None) -> None:
    """Run the workflow locally through snakemake.api (raises on a failed job)."""
    from unittest import mock

    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, DAGSettings, ExecutionSettings, OutputSettings, ResourceSettings

    with mock.patch.dict(os.environ, IN_PROCESS_ENGINES), SnakemakeApi(OutputSettings(show_failed_logs=True)) as api:
        wf = api.workflow(
            resource_settings=ResourceSettings(cores=cores, resources=resources or {}),
            config_settings=ConfigSettings(configfiles=[configfile]),
            snakefile=ROOT / "Snakefile",
            workdir=workdir,
        )
        wf.dag(DAGSettings()).execute_workflow(executor="local", execution_settings=ExecutionSettings(latency_wait=5))
