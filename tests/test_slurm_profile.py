"""profiles/slurm without a cluster: what Snakemake reads from it (dry-runs and argument parsing, seconds).

tests/test_slurm.py runs it for real on a local Slurm cluster.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_support import make_workdir

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "profiles" / "slurm"


pytestmark = pytest.mark.workflow


def dry_run(wd: Path, *args: str) -> subprocess.CompletedProcess:
    cfg = make_workdir(wd)
    cmd = [sys.executable, "-m", "snakemake", "-n", "-s", str(ROOT / "Snakefile"), "-d", str(wd), *args, "--configfile", str(cfg)]
    return subprocess.run(cmd, cwd=wd, capture_output=True, text=True)


def job_resources(out: str) -> dict[str, dict[str, str]]:
    """rule -> its resources line of a dry-run, as a dict (the last job of each rule)."""
    res = {}
    for block in re.split(r"^(?=(?:local)?rule \w+:$)", out, flags=re.M):
        rule = re.search(r"^(?:local)?rule (\w+):", block, re.M)
        line = re.search(r"^\s+resources: (.*)$", block, re.M)
        if rule and line:
            res[rule.group(1)] = dict(kv.split("=", 1) for kv in line.group(1).split(", "))
    return res


def test_profile_resources_and_the_profiles_default_overlap():
    from snakemake.cli import parse_args

    _, args = parse_args(["--profile", str(PROFILE), "-s", str(ROOT / "Snakefile"), "-n"])
    assert args.executor == "slurm" and args.jobs == 100
    # profiles/default (read too, and winning per key) must not take latency-wait back to a local value
    assert args.latency_wait == 60 and args.rerun_incomplete and args.show_failed_logs
    assert args.resources["full_model"].value == 100
    assert args.config == ["resources={'host_lock': False}"]
    assert str(args.slurm_logdir) == "logs/slurm" and args.slurm_keep_successful_logs


def test_profile_dry_run_gives_each_rule_its_sbatch_resources(tmp_path):
    r = dry_run(tmp_path, "--profile", str(PROFILE))
    assert r.returncode == 0, r.stderr[-3000:]
    res = job_resources(r.stdout + r.stderr)
    for rule in ("generate_traces", "extract_hidden_states", "train_drafter"):
        assert (res[rule]["mem_mb"], res[rule]["runtime"], res[rule]["gpu"]) == ("16000", "1440", "1"), rule
    assert (res["evaluate_drafter"]["runtime"], res["evaluate_drafter"]["gpu"]) == ("240", "1")
    assert res["generate_traces"]["full_model"] == "1" and res["generate_traces"]["tasks_per_gpu"] == "0"
    assert (res["prepare_prompts"]["mem_mb"], res["prepare_prompts"]["runtime"]) == ("8000", "60")
    assert all("gpu" not in res[rule] for rule in ("prepare_prompts", "summarize_run", "plot_run", "write_manifest"))


def test_host_lock_in_a_config_mapping_is_read_as_a_boolean(tmp_path):
    # Snakemake hands `false` nested in a --config mapping over as a string; the schema wants a boolean
    assert dry_run(tmp_path / "a", "--cores", "1", "--config", "resources={host_lock: false}").returncode == 0
    bad = dry_run(tmp_path / "b", "--cores", "1", "--config", "resources={host_lock: maybe}")
    assert bad.returncode != 0 and "resources.host_lock: 'maybe' is not of type 'boolean'" in bad.stdout + bad.stderr
