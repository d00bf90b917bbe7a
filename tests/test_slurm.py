"""SLURM: the reduced end-to-end run through `snakemake --profile profiles/slurm` on a one-node
Slurm cluster on this machine, checked job by job in Slurm's accounting and compared with the
local run of the same config (the session fixture e2e_run).

tests/slurm/start-local-slurm.sh installs and starts the cluster (slurmctld, slurmd, slurmdbd
with a private MariaDB, munge; fake `gpu` GRES of type `fake`); that needs root. Without root,
or when the cluster cannot start, the test is skipped; with CI=true it fails instead.
"""

import json
import os
import re
import shutil
import subprocess
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from slurm_support import ACCOUNT, GPU_MODEL, GPU_RULES, PARTITION, SlurmRun, take_background

ROOT = Path(__file__).resolve().parents[1]
START = ROOT / "tests" / "slurm" / "start-local-slurm.sh"
STOP = ROOT / "tests" / "slurm" / "stop-local-slurm.sh"
pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

THREADED_RULES = GPU_RULES | {"prepare_target_model"}  # threads: resources.threads (2)
# Every job of the reduced run, as the plugin names it in the job comment: rule_<rule>[_wildcards_<values>]
EXPECTED_JOBS = {
    "rule_prepare_target_model": "prepare_target_model",
    "rule_prepare_prompts": "prepare_prompts",
    "rule_prepare_eval_prompts": "prepare_eval_prompts",
    "rule_generate_traces_wildcards_00000": "generate_traces",
    "rule_generate_traces_wildcards_00001": "generate_traces",
    "rule_build_vocab_mapping": "build_vocab_mapping",
    "rule_extract_hidden_states_wildcards_00000": "extract_hidden_states",
    "rule_extract_hidden_states_wildcards_00001": "extract_hidden_states",
    "rule_train_drafter": "train_drafter",
    "rule_evaluate_drafter": "evaluate_drafter",
    "rule_summarize_run": "summarize_run",
    "rule_plot_run": "plot_run",
    "rule_write_manifest": "write_manifest",
}
SACCT_FIELDS = [
    "JobIDRaw",
    "JobID",
    "JobName",
    "Comment",
    "State",
    "ExitCode",
    "Partition",
    "Account",
    "AllocTRES",
    "Submit",
    "Start",
    "End",
]


def _unavailable(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"the SLURM test must run in CI, but: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm_cluster():
    """The local cluster, started if needed; stopped again afterwards only if this fixture started it."""
    if os.geteuid() != 0:
        _unavailable("needs root: tests/slurm/start-local-slurm.sh installs Slurm with apt-get and starts its daemons")
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        _unavailable("Slurm is not installed and there is no apt-get to install it")
    r = subprocess.run(["bash", str(START)], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        _unavailable(f"the local Slurm cluster did not start:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    started = "starting slurmctld" in r.stdout
    try:
        profile = yaml.safe_load((ROOT / "profiles/slurm/config.yaml").read_text())
        need = max(int(v.get("mem_mb", 0)) for v in profile["set-resources"].values())
        have = int(subprocess.run(["sinfo", "-h", "-N", "-o", "%m"], capture_output=True, text=True).stdout.split()[0])
        if have < need:
            _unavailable(f"the node has {have} MB of memory, profiles/slurm asks for up to {need} MB per job")
        yield
    finally:
        if started:
            subprocess.run(["bash", str(STOP)], capture_output=True, check=False)


def sacct(*args: str) -> list[dict]:
    out = subprocess.run(
        ["sacct", "--parsable2", "--noheader", f"--format={','.join(SACCT_FIELDS)}", *args], capture_output=True, text=True, check=True
    ).stdout
    return [dict(zip(SACCT_FIELDS, line.split("|"), strict=True)) for line in out.splitlines() if line]


@pytest.fixture(scope="module")
def slurm_run(slurm_cluster, tmp_path_factory):
    """The run started when pytest collected this module (slurm_support), or started now."""
    bg = take_background()
    run = bg or SlurmRun(tmp_path_factory.mktemp("slurm-wd"))
    try:
        r = run.wait()
        assert r.returncode == 0, r.stderr[-6000:]
        (run_id,) = re.findall(r"SLURM run ID: (\S+)", r.stderr)
        submitted = re.findall(r"Job \d+ has been submitted with SLURM jobid (\d+)", r.stderr)
        rows = sacct("--allocations", "--name", run_id)
        steps = sacct("--jobs", ",".join(j["JobIDRaw"] for j in rows)) if rows else []
        yield SimpleNamespace(
            wd=run.wd, res=run.wd / "results" / "e2e", profile=run.profile, locks=run.locks, submitted=submitted, jobs=rows, steps=steps
        )
    finally:
        if bg is not None:
            bg.stop()  # not a pytest temporary directory: removed here


def test_every_job_went_through_sbatch_with_the_profile_resources(slurm_run):
    jobs = {j["Comment"]: j for j in slurm_run.jobs}
    # one SLURM job per Snakemake job (the `all` target is a local rule), and nothing else under this run's name
    assert len(slurm_run.jobs) == len(EXPECTED_JOBS) and set(jobs) == set(EXPECTED_JOBS)
    assert sorted(slurm_run.submitted) == sorted(j["JobIDRaw"] for j in slurm_run.jobs)
    defaults, per_rule = slurm_run.profile["default-resources"], slurm_run.profile["set-resources"]
    for comment, j in jobs.items():
        rule = EXPECTED_JOBS[comment]
        assert (j["State"], j["ExitCode"]) == ("COMPLETED", "0:0"), comment
        assert (j["Partition"], j["Account"]) == (PARTITION, ACCOUNT), comment
        tres = dict(x.split("=", 1) for x in j["AllocTRES"].split(","))
        assert tres["cpu"] == ("2" if rule in THREADED_RULES else "1"), comment
        assert tres["mem"] == f"{per_rule.get(rule, {}).get('mem_mb', defaults['mem_mb'])}M", comment
        if rule in GPU_RULES:
            assert tres["gres/gpu"] == "1" and tres[f"gres/gpu:{GPU_MODEL}"] == "1", comment
        else:
            assert "gres/gpu" not in tres, comment
        # the rule ran as a job step under srun (snakemake-executor-plugin-slurm-jobstep)
        step = next(s for s in slurm_run.steps if s["JobID"] == f"{j['JobIDRaw']}.0")
        assert step["State"] == "COMPLETED", comment
        wildcards = comment.removeprefix(f"rule_{rule}").removeprefix("_wildcards_")
        assert (slurm_run.wd / "logs" / "slurm" / f"rule_{rule}" / wildcards / f"{j['JobIDRaw']}.log").is_file(), comment


def test_full_model_jobs_are_not_serialized_by_the_workflow_on_slurm(slurm_run):
    # Snakemake submitted both generation jobs at once (full_model limit raised by the profile) ...
    gen = [j for j in slurm_run.jobs if EXPECTED_JOBS[j["Comment"]] == "generate_traces"]
    t = {k: [datetime.fromisoformat(j[k]) for j in gen] for k in ("Submit", "End")}
    assert max(t["Submit"]) < min(t["End"])
    # ... and no job took the host-wide lock (resources.host_lock: false from the profile's config)
    assert not slurm_run.locks.exists()


def _json_without_run_specifics(path: Path, wd: Path):
    """JSON with wall-clock and memory figures and file stats (inode, times) dropped, the run directory replaced by <wd>
    and start plans' times by <time>."""

    def norm(x):
        if isinstance(x, dict):
            drop = r"seconds|per_second|speedup|over_estimate|peak_|^stat$|_stat$"
            return {k: norm(v) for k, v in x.items() if not re.search(drop, k)}
        if isinstance(x, list):
            return [norm(v) for v in x]
        if isinstance(x, str):  # the run directory, and the start plan's name (its UTC start time); the local
            # run also measures the speedup (e2e_support.SMALL_WITH_SPEEDUP), which its plan's source names
            x = re.sub(r"; speedup measurement \d+ s: .*", "", x, flags=re.S)
            return re.sub(r"start-\d{8}T\d{6}\.\d+Z\.json", "start-<time>.json", x.replace(str(wd), "<wd>"))
        return x

    if path.suffix == ".jsonl":
        return [norm(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    return norm(json.loads(path.read_text()))


def test_outputs_equal_the_local_run(slurm_run, request):
    # the local run only now: as a parameter, the session-scoped fixture would run before the skip above
    local_wd, _, local = request.getfixturevalue("e2e_run")
    remote = slurm_run.res

    def outputs(res):
        """What the jobs wrote: not the plans, which each invocation makes (start time, `snakemake plan`), nor the
        integrity records beside outputs (``.sha256*.json``: stats of files on this disk, notes of later checks)."""
        return sorted(
            f
            for f in (p.relative_to(res) for p in res.rglob("*") if p.is_file() and not p.name.startswith(".sha256"))
            if f.parts[0] not in ("plans", "plan.json")
        )

    files = outputs(local)
    assert files == outputs(remote)
    assert len(list((local / "plans").glob("start-*.json"))) == len(list((remote / "plans").glob("start-*.json"))) == 1
    # the same bytes: prompts, traces (token ids, text, seeds, engine identity), vocab, hidden
    # states, drafter weights, evaluation outputs
    byte_equal = [
        *(f for f in files if f.parts[0] in ("prompts", "traces", "vocab") and f.suffix in (".jsonl", ".npy")),
        *(f for f in files if f.parts[0] == "hidden_states" and f.suffix == ".safetensors"),
        *(Path(f) for f in ("drafter/model.safetensors", "drafter/config.py", "eval/prompts.jsonl", "eval/outputs.jsonl")),
    ]
    # prompts: 2 shards + rejects; traces: 2 x (shard, rejects); vocab: 3 arrays; hidden states: 2 shards
    assert len(byte_equal) == 3 + 4 + 3 + 2 + 4
    for f in byte_equal:
        assert (local / f).read_bytes() == (remote / f).read_bytes(), f
    # every JSON output (counts, coverage, shard manifests with their SHA-256, losses per step,
    # tau, summaries) equal but for wall-clock figures and run directory paths
    for f in (f for f in files if f.suffix in (".json", ".jsonl") and f not in byte_equal and f != Path("manifest.json")):
        a, b = _json_without_run_specifics(local / f, local_wd), _json_without_run_specifics(remote / f, slurm_run.wd)
        assert a == b, f
    # the run manifest: the same graph, the same hashes of the byte-equal files, the same identity
    # (files with wall-clock figures or paths, e.g. train/summary.json or drafter/config.json, hash differently)
    ma, mb = (json.loads((r / "manifest.json").read_text()) for r in (local, remote))
    assert ma["artifacts"].keys() == mb["artifacts"].keys()

    def edges(node):
        return node["rule"], node["wildcards"], [(i["name"], i["path"]) for i in node["inputs"]]

    for k in ma["artifacts"]:
        assert edges(ma["artifacts"][k]) == edges(mb["artifacts"][k]), k
    for f in byte_equal:
        a, b = ((m["artifacts"].get(str(f)) or m["artifacts"][f.parts[0]]["files"][Path(*f.parts[1:]).as_posix()]) for m in (ma, mb))
        assert a["sha256"] == b["sha256"], f
    for key in ("target", "engine", "sampling", "vocab", "layer_ids", "prompts", "evaluation_prompts"):
        assert ma["identity"][key] == mb["identity"][key], key
    assert ma["identity"]["training"]["config"] == mb["identity"]["training"]["config"]
    assert all(c["ok"] for c in ma["checks"] + mb["checks"])
    acc = json.loads((remote / "eval/acceptance.json").read_text())
    assert acc["num_drafts"] > 0 and acc["acceptance_length"] >= 1.0
