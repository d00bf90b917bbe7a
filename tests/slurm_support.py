"""The SLURM test's workflow run, started in the background as soon as pytest has collected a
SLURM test and the local cluster is already up (.ci/run starts it before `make test`).

The run itself is mostly waiting: snakemake-executor-plugin-slurm sleeps 5 s before each sbatch
and lengthens its status-check interval by 10 s while no job finishes, so on its own it takes
about 160 s longer than the same run done locally. Started at collection, that waiting overlaps
the rest of the suite; test_slurm.py's fixture then waits for it to end. Without a running cluster
at collection time (e.g. the fixture starts it), the fixture launches the run itself.
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from e2e_support import IN_PROCESS_ENGINES, ROOT, make_workdir

# What start-local-slurm.sh sets up, filled into the profile's CHANGE placeholders.
PARTITION, ACCOUNT, GPU_MODEL = "debug", "eagle3", "fake"
GPU_RULES = {"generate_traces", "extract_hidden_states", "evaluate_drafter", "train_drafter"}
RUN_TIMEOUT_S = 900


def cluster_up() -> bool:
    """True when this process may use the local cluster (root) and its controller answers now."""
    if os.geteuid() != 0 or not shutil.which("sinfo"):
        return False
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%a"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0 and "up" in r.stdout


def filled_profile(dest: Path) -> dict:
    """profiles/slurm with its partition, account and gpu_model placeholders set for the local cluster."""
    profile = yaml.safe_load((ROOT / "profiles" / "slurm" / "config.yaml").read_text())
    profile["default-resources"].update(slurm_partition=PARTITION, slurm_account=ACCOUNT)
    for rule in GPU_RULES:
        profile["set-resources"][rule]["gpu_model"] = GPU_MODEL
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.yaml").write_text(yaml.safe_dump(profile))
    return profile


class SlurmRun:
    """The reduced config run through ``snakemake --profile <filled profiles/slurm>`` in a fresh
    run directory, as a child process writing its output to files there."""

    def __init__(self, wd: Path):
        self.wd = wd
        cfg = make_workdir(wd)
        self.profile = filled_profile(wd / "profile")
        self.locks = wd / "host-locks"  # a full-model job with the host lock on would create it
        cmd = [sys.executable, "-m", "snakemake", "--profile", str(wd / "profile"), "-s", str(ROOT / "Snakefile"), "-d", str(wd)]
        cmd += ["--configfile", str(cfg), "--slurm-init-seconds-before-status-checks", "1"]  # first check after 1 s, not 40
        self._out, self._err = (wd / "snakemake.stdout").open("w"), (wd / "snakemake.stderr").open("w")
        env = {**os.environ, **IN_PROCESS_ENGINES, "EAGLE3_LOCK_DIR": str(self.locks)}
        self.proc = subprocess.Popen(cmd, cwd=wd, env=env, stdout=self._out, stderr=self._err, text=True, start_new_session=True)

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
        """Wait for the run to end; its return code and output (raises TimeoutExpired after ``timeout`` s)."""
        self.proc.wait(timeout=timeout)
        self._out.close()
        self._err.close()
        out, err = ((self.wd / f"snakemake.{s}").read_text() for s in ("stdout", "stderr"))
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)

    def stop(self) -> None:
        """End a run still going (SIGTERM: Snakemake cancels its SLURM jobs), then remove its directory."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.wd, ignore_errors=True)


_background: SlurmRun | None = None


def start_in_background() -> None:
    """Start the run now when the cluster is up (pytest_collection_finish, once)."""
    global _background
    if _background is None and cluster_up():
        _background = SlurmRun(Path(tempfile.mkdtemp(prefix="slurm-wd-")))


def take_background() -> SlurmRun | None:
    """The run started at collection, handed to one caller (the fixture), or None."""
    global _background
    run, _background = _background, None
    return run


def stop_background() -> None:
    """End a run started at collection but never taken (its tests deselected or skipped)."""
    run = take_background()
    if run is not None:
        run.stop()
