"""The benchmark scripts' orchestration (benchmarks/phases.py and the scripts that use it), with tiny fake
phases: no GPU, no engine. A phase runs in its own session with its output in a log file and what it
leaves running is stopped; a failed phase is recorded with its error and log and the script exits 1;
inputs are checked before the first phase; vs_speculators' ``all`` hands its options to its phases."""

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import phases  # noqa: E402
import vs_speculators  # noqa: E402

#: A phase that starts a long sleeper holding its stdout (in its process group, or in a session of its
#: own as ``vllm serve`` is started), writes the sleeper's pid to argv[2], prints a line and exits 3.
LEAVES_A_CHILD = """
import subprocess, sys
child = subprocess.Popen(["sleep", "120"], start_new_session=sys.argv[1] == "own-session")
open(sys.argv[2], "w").write(str(child.pid))
print("the phase failed here", flush=True)
sys.exit(3)
"""


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped by its new parent, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def child_pids():
    """Pids of sleepers a test's fake phases start; any still running at the end are killed (and the test fails)."""
    pids: list[int] = []
    yield pids
    left = [p for p in pids if running(p)]
    for p in left:
        os.kill(p, 9)
    assert not left, f"sleepers left running: {left}"


@pytest.mark.parametrize("where", ["process-group", "own-session"])
def test_a_failed_phase_leaving_a_child_on_its_output_returns_at_once_and_the_child_is_stopped(tmp_path, where, child_pids):
    script = tmp_path / "phase.py"
    script.write_text(LEAVES_A_CHILD)
    t = time.monotonic()
    run = phases.run_phase([sys.executable, script, where, tmp_path / "pid"], tmp_path / "logs" / "phase.log", grace=5)
    elapsed = time.monotonic() - t
    child_pids.append(int((tmp_path / "pid").read_text()))
    assert elapsed < 30  # the sleeper holds the phase's stdout for 120 s: a pipe reader would wait that long
    assert not running(child_pids[0])
    assert (run.returncode, run.timed_out, run.leftovers, run.ok) == (3, False, 1, False)
    assert run.error == "exit 3: the phase failed here"
    assert run.log == tmp_path / "logs" / "phase.log" and "the phase failed here" in run.log.read_text()
    assert run.record() == {
        "wall_seconds": round(run.seconds, 1),
        "log": str(tmp_path / "logs" / "phase.log"),
        "leftover_processes": 1,
        "returncode": 3,
        "error": "exit 3: the phase failed here",
    }


def test_a_phase_past_its_timeout_is_stopped(tmp_path):
    t = time.monotonic()
    run = phases.run_phase(
        [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(120)"], tmp_path / "p.log", timeout=1
    )
    assert time.monotonic() - t < 30
    assert run.timed_out and not run.ok and run.returncode == -15
    assert run.error == "stopped after its 1 s timeout: started"


def test_a_successful_phase_records_its_time_and_log_only(tmp_path):
    run = phases.run_phase([sys.executable, "-c", "print('fine')"], tmp_path / "p.log")
    assert run.ok and run.error is None and run.leftovers == 0
    assert run.record() == {"wall_seconds": round(run.seconds, 1), "log": str(tmp_path / "p.log")}


def test_results_record_a_failed_inline_phase_and_the_exit_status(tmp_path):
    res = phases.Results(tmp_path / "new" / "r.json", {"command": "x"})

    def broken() -> dict:
        raise phases.PhaseError("the trainer failed", tmp_path / "train.log")

    assert res.inline("first", lambda: {"value": 1}) == {"value": 1}
    assert res.inline("second", broken) is None
    written = json.loads((tmp_path / "new" / "r.json").read_text())
    assert written["phases"]["first"] == {"value": 1}
    second = written["phases"]["second"]
    assert second["error"] == "PhaseError: the trainer failed" and second["log"] == str(tmp_path / "train.log")
    assert written["failed"] == ["second"]
    assert res.finish() == 1
    res.put("second", {"value": 2})  # run again, successfully
    assert res.failed == [] and res.finish() == 0


def test_the_drivers_command_line_records_each_phase_and_fails_at_the_end(tmp_path, capsys):
    rec = tmp_path / "d_phases.json"
    assert phases.main(["start", "--json", str(rec), "--command", "bash driver.sh"]) == 0
    assert (
        phases.main(["run", "--json", str(rec), "--name", "ok", "--log", str(tmp_path / "ok.log"), "--", sys.executable, "-c", "pass"]) == 0
    )
    bad = [sys.executable, "-c", "import sys; print('no drafter'); sys.exit(5)"]
    assert phases.main(["run", "--json", str(rec), "--name", "bad", "--log", str(tmp_path / "bad.log"), "--", *bad]) == 5
    assert phases.main(["finish", "--json", str(rec)]) == 1
    written = json.loads(rec.read_text())
    assert written["command"] == "bash driver.sh" and written["failed"] == ["bad"]
    assert written["phases"]["bad"]["error"] == "exit 5: no drafter"
    assert written["phases"]["bad"]["log"] == str(tmp_path / "bad.log")
    assert "failed: bad; errors and logs in" in capsys.readouterr().err


def test_a_missing_package_or_path_stops_a_driver_before_its_first_phase(capsys):
    with pytest.raises(SystemExit) as e:
        phases.main(["check", "--packages", "json", "no_such_package_here", "--paths", "benchmarks/phases.py", "no/such/file.yaml"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "package no_such_package_here is not installed" in err and "gpu-host-setup.sh" in err
    assert "no/such/file.yaml does not exist" in err
    assert len(err.strip().splitlines()) == 3  # "cannot start:" and the two problems, nothing on what is there


def test_workflow_outputs_asks_snakemake_for_the_missing_ones_only(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(phases, "run_phase", lambda cmd, log, **kw: calls.append((cmd, log, kw)) or "ran")
    assert phases.workflow_outputs([ROOT / "README.md", "Snakefile"], tmp_path / "s.log") is None
    missing = [ROOT / "results" / "no-such-run" / "vocab", "results/no-such-run/prompts/shard-00000.jsonl"]
    assert phases.workflow_outputs([ROOT / "README.md", *missing], tmp_path / "s.log", cores=2) == "ran"
    cmd, log, kw = calls[0]
    assert cmd == [sys.executable, "-m", "snakemake", "--cores", "2", "--", "results/no-such-run/vocab", missing[1]]
    assert log == tmp_path / "s.log" and kw == {"timeout": None, "cwd": ROOT}


# --- vs_speculators ----------------------------------------------------------------------------------


def test_all_hands_every_option_to_its_phases_the_tokenizer_included(tmp_path):
    ap = vs_speculators.parser()
    given = ["--work", str(tmp_path / "w"), "--tokenizer", str(tmp_path / "tok"), "--samples", "8", "--concurrency", "3"]
    given += ["--steps", "5", "--draft-vocab", "100", "--gen-prompts", "7", "--only", "samples", "--timeout", "9"]
    args = ap.parse_args(["all", *given])
    argv = vs_speculators.phase_argv(ap, args, "samples", tmp_path / "part.json")
    assert argv[:4] == [sys.executable, str(ROOT / "benchmarks" / "vs_speculators.py"), "samples", "--out"]
    assert argv[argv.index("--tokenizer") + 1] == str(tmp_path / "tok")
    phase = ap.parse_args(argv[2:])  # what the phase sees: the parent's options, its own phase and result file
    assert phase.out == str(tmp_path / "part.json") and phase.only is None and phase.timeout == 3600
    same = {k: v for k, v in vars(args).items() if k not in vs_speculators.NOT_FORWARDED}
    assert {k: v for k, v in vars(phase).items() if k not in vs_speculators.NOT_FORWARDED} == same


def test_the_vllm_backend_is_compared_with_prefill_warm_and_with_its_first_pass(monkeypatch):
    monkeypatch.setattr(vs_speculators, "_params", lambda: 8_000_000_000)
    res = {
        "prefill": {"tokens_per_second": 40000.0, "first_pass": {"tokens_per_second": 36000.0}},
        "ours_vllm": {"tokens_per_second": 38000.0},
    }
    ratios = vs_speculators.summarize(res)["ratios"]
    assert ratios == {
        "ours_vllm / vllm prefill only (goal >= 0.97)": pytest.approx(0.95),
        "ours_vllm / vllm prefill only, its first pass": pytest.approx(38000 / 36000),
    }
    del res["prefill"]["first_pass"]  # results from before the first pass was timed
    assert list(vs_speculators.summarize(res)["ratios"]) == ["ours_vllm / vllm prefill only (goal >= 0.97)"]


#: Logs step records as ``speculators train`` 0.9 does (its own logging setup and its trainer's record), one
#: step per (tokens, seconds) in argv[1] (JSON), to stdout as in a phase's log.
SPECULATORS_STEP_LOG = """
import json, logging, sys
from speculators.train.logger import setup_metric_logger, setup_root_logger
setup_root_logger()
setup_metric_logger([], "run", sys.argv[2])
log = logging.getLogger("speculators.metrics")
for step, (tokens, seconds) in enumerate(json.loads(sys.argv[1])):
    profile = {"fetch_ms": 0.4, "fwd_ms": 1.0, "step_ms": seconds * 1000, "tokens_per_s": tokens / seconds, "memory_mb": {"start": 1.0}}
    log.info({"train": {"loss": 3.2, "full_acc_0": 0.1}, "profile": profile, "epoch": 0, "lr": 1e-4, "global_step": step}, extra={"step": step})
logging.getLogger("speculators").info("Updated checkpoint_best -> 0 (loss_epoch=3.377105)")
"""


@pytest.mark.processes
def test_the_steady_rate_of_speculators_train_is_read_from_its_own_log_records(tmp_path):
    """The log is written by speculators' own logging setup (as ``train_speculators`` runs it, COLUMNS=1000),
    and the rate is checked against the steps' tokens and seconds: an H100 run's parser found no step
    in such a log (it looked for ``profile.step_ms``; speculators 0.9 prints ``profile/step_ms=1.23e+03``)."""
    steps = [(7000 + 37 * i, 5.0 if i == 0 else 0.1 + 0.003 * (i % 7)) for i in range(40)]
    run = subprocess.run(
        [sys.executable, "-c", SPECULATORS_STEP_LOG, json.dumps(steps), str(tmp_path)],
        capture_output=True, text=True, env=os.environ | {"COLUMNS": "1000"}, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    got = vs_speculators._speculators_steady(run.stdout + run.stderr)
    rest = steps[4:]  # the first 10% of the steps are warm-up, as in train_drafter's figure
    expected = sum(t for t, _ in rest) / sum(s for _, s in rest)
    assert got["steps_logged"] == 40
    assert got["warmup_seconds"] == pytest.approx(sum(s for _, s in steps[:4]), rel=0.01)
    # the log prints 3 significant digits of each step's milliseconds and tokens/s
    assert got["steady_tokens_per_second"] == pytest.approx(expected, rel=0.01)
    assert got["tokens_seen"] == pytest.approx(sum(t for t, _ in steps), rel=0.01)
    assert vs_speculators._speculators_steady("train: 100%|#####| 53/53\nINFO Updated checkpoint_best") == {"steps_logged": 0}


def _fake_phases(monkeypatch, tmp_path) -> Path:
    """vs_speculators' phases replaced by a script that records the options it was given; ``target`` leaves a
    sleeper on its output (pid in ``tmp_path/pid``) and fails. No package or GPU check (a CPU machine)."""
    script = tmp_path / "fake_phase.py"
    script.write_text(
        textwrap.dedent(f"""
        import json, subprocess, sys
        phase, out = sys.argv[1], sys.argv[sys.argv.index("--out") + 1]
        if phase == "target":
            child = subprocess.Popen(["sleep", "120"], start_new_session=True)
            open({str(tmp_path / "pid")!r}, "w").write(str(child.pid))
            print("CUDA out of memory", flush=True)
            sys.exit(1)
        json.dump({{"argv": sys.argv[2:]}}, open(out, "w"))
        """)
    )
    real = vs_speculators.phase_argv

    def fake_argv(ap, args, phase, out):
        return [sys.executable, str(script), *real(ap, args, phase, out)[2:]]

    monkeypatch.setattr(vs_speculators, "phase_argv", fake_argv)
    monkeypatch.setattr(phases, "missing_packages", lambda modules: [])
    monkeypatch.setattr(phases, "no_cuda", lambda: [])
    return script


def test_all_creates_its_work_folder_records_a_failed_phase_and_goes_on(tmp_path, monkeypatch, child_pids):
    _fake_phases(monkeypatch, tmp_path)
    (tmp_path / "tok").mkdir()
    work = tmp_path / "new" / "work"
    argv = ["vs_speculators.py", "all", "--work", str(work), "--tokenizer", str(tmp_path / "tok"), "--only", "samples", "target", "prefill"]
    monkeypatch.setattr(sys, "argv", argv)
    t = time.monotonic()
    with pytest.raises(SystemExit) as e:
        vs_speculators.main()
    child_pids.append(int((tmp_path / "pid").read_text()))
    assert e.value.code == 1
    assert time.monotonic() - t < 60 and not running(child_pids[0])
    written = json.loads((work / "vs_speculators.json").read_text())
    samples, target, prefill = (written["phases"][p] for p in ("samples", "target", "prefill"))
    assert samples["argv"][samples["argv"].index("--tokenizer") + 1] == str(tmp_path / "tok")
    assert target["error"] == "exit 1: CUDA out of memory" and target["returncode"] == 1
    assert target["log"] == str(work / "log-target.txt") and target["leftover_processes"] == 1
    assert "argv" in prefill and "error" not in prefill  # the phases after a failed one still run
    assert target["phase_command"].split()[2:4] == ["target", "--out"] and "--tokenizer" in target["phase_command"]
    assert written["failed"] == ["target"]


def test_all_names_what_its_phases_miss_before_the_first_one(tmp_path, monkeypatch, capsys):
    _fake_phases(monkeypatch, tmp_path)
    work = tmp_path / "w"
    monkeypatch.setattr(sys, "argv", ["vs_speculators.py", "all", "--work", str(work), "--tokenizer", str(tmp_path / "no-tok")])
    with pytest.raises(SystemExit) as e:
        vs_speculators.main()
    assert e.value.code == 2 and not work.exists()
    assert f"--tokenizer {tmp_path / 'no-tok'} is not a directory" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["vs_speculators.py", "all", "--work", str(work), "--only", "ours_hf", "train_ours"])
    with pytest.raises(SystemExit) as e:
        vs_speculators.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and not work.exists()
    assert f"{work / 'hs-vllm'} does not exist: phase ours_vllm writes it" in err
    assert f"{work / 'traces.jsonl'} does not exist: phase samples writes it" in err
    assert "hs-hf" not in err  # train_ours does not read it


# --- the scripts of a finished run, and the drivers ---------------------------------------------------


def test_drafter_gap_names_the_missing_run_files_with_the_command_that_makes_them():
    from drafter_gap import input_problems

    from eagle3_pipeline.config import validate_config

    cfg = validate_config({"run": "no-such-run", "prompts": {"num_shards": 2}})
    drafter = str((ROOT / "results" / "no-such-run" / "drafter").resolve())
    (line,) = [p for p in input_problems(cfg, ["my.yaml"], drafter) if "no-such-run" in p]
    files = [f"results/no-such-run/hidden_states/shard-0000{i}.safetensors" for i in (0, 1)]
    files += [f"results/no-such-run/traces/shard-0000{i}.jsonl" for i in (0, 1)]
    files += ["results/no-such-run/eval/prompts.jsonl", "results/no-such-run/drafter"]
    # the embedded target too, in a checkout where no run has made it yet (a fresh clone)
    files += [] if (ROOT / "resources/models/smollm2-135m-instruct/config.json").is_file() else ["resources/models/smollm2-135m-instruct"]
    assert line.endswith(f"run the workflow first, .venv/bin/snakemake --cores all --configfile my.yaml -- {' '.join(files)}")


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="on a GPU host the driver would start its pipeline")
@pytest.mark.parametrize("driver", ["drafter_gap_h200.sh", "sweep_h200.sh"])
def test_an_h200_driver_stops_before_its_first_phase_without_a_gpu(tmp_path, driver):
    r = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / driver)],
        cwd=tmp_path,
        env={**os.environ, "OUT": "out"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "no CUDA GPU visible to torch" in r.stderr
    assert list((tmp_path / "out").iterdir()) == []  # no phase ran, no record started


@pytest.mark.processes
def test_the_hashing_benchmark_runs_as_documented_and_its_two_ways_agree(tmp_path):
    """benchmarks/hash_while_writing.py at a small size: both phases ran, the digest taken while
    filling equals ``sha256_file``'s after, and the shard is the size asked for."""
    out = tmp_path / "h.json"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/hash_while_writing.py"),
            "--gib",
            "0.125",
            "--rounds",
            "1",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "w"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["failed"] == [] and doc["summary"]["digests_equal"] is True
    assert set(doc["phases"]) == {"after_0", "while_0"}
    assert abs(doc["summary"]["bytes"] - 0.125 * 2**30) <= 1000 * 4 * 4096 * 2  # within one sample: 1,000 tokens x 4 layers x 4,096 x bf16
    assert not (tmp_path / "w").exists()


@pytest.mark.processes
def test_the_writer_benchmark_runs_as_documented_and_fills_the_shard_it_times(tmp_path):
    """benchmarks/writer_throughput.py with 2 requests: every step timed, each thread count's rounds ran
    (a round that left its chunk unfinished fails the phase), and the GB/s are the requests' bytes over
    positive times."""
    out = tmp_path / "w.json"
    argv = ["--requests", "2", "--threads", "1", "2", "--repeats", "2", "--rounds", "2", "--out", str(out), "--work", str(tmp_path / "w")]
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/writer_throughput.py"), *argv], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["failed"] == [] and set(doc["phases"]) == {"parts", "filler_1", "filler_2"}
    parts = doc["phases"]["parts"]
    assert parts["request_bytes"] == 1000 * 4 * 4096 * 2  # 1,000 tokens x 4 layers x 4,096 x bf16
    for step in ("index_select", "isfinite_all (before)", "all_finite (now)", "write_states"):
        assert parts[step]["ms_per_request"] > 0
        assert parts[step]["gbps"] == pytest.approx(parts["request_bytes"] / parts[step]["ms_per_request"] / 1e6, rel=0.02)
    for n in (1, 2):
        f = doc["phases"][f"filler_{n}"]
        assert f["threads"] == n and len(f["round_gbps"]) == 2 and f["gbps"] > 0
        assert f["vs_prefill"] == pytest.approx(f["gbps"] / 1.42, abs=0.01)
    assert not (tmp_path / "w").exists()


@pytest.mark.processes
def test_the_hf_backend_profile_runs_as_documented_at_a_tiny_shape(tmp_path):
    """benchmarks/hf_backend_profile.py --tiny on CPU: every measurement ran over the samples it drew
    (their token count recomputed here from the same seed), its MFU is tokens/s x 2 x parameters
    over the peak given, and packed rows give batch 1's states."""
    import numpy as np

    out = tmp_path / "p.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/hf_backend_profile.py"), "--tiny", "--samples", "6", "--min-len", "40",
           "--max-len", "90", "--batch-tokens", "256", "--peak-tflops", "1", "--profile", "--packed", "sdpa", "--out", str(out),
           "--writes", str(tmp_path / "w")]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    m = doc["phases"]
    rng = np.random.default_rng(0)
    lengths = []
    for _ in range(6):  # make_samples' draws: a length, then that many ids
        lengths.append(int(rng.integers(40, 91)))
        rng.integers(0, 4096, size=lengths[-1])
    tokens = sum(lengths)
    assert doc["failed"] == [] and m["setup"]["tokens"] == tokens and m["setup"]["layer_ids"] == [2, 4, 5, 8]
    # padding-free rows, masked per sample by transformers: the same states as one sample at a time, to bf16 rounding
    assert m["packed_sdpa_bt256"]["max_rel_error_vs_batch1"] < 0.02 and m["padded_error"]["max_rel_error_vs_batch1"] < 0.02
    for k in ("forward_bt256", "extract_hf_bt256", "batch1", "packed_sdpa_bt256"):
        assert m[k]["tokens_per_second"] == pytest.approx(tokens / m[k]["seconds"], rel=0.01)
        assert m[k]["mfu"] == pytest.approx(m[k]["tokens_per_second"] * 2 * m["setup"]["parameters"] / 1e12, rel=0.01)
    assert m["profile_extract_hf_bt256"]["samples"] == 4
    # the job's writes, both ways: the batch writer wrote every token's 4 layers x 256 bf16 once, in
    # make_batches' batches of the one chunk, and the shard's folder is gone
    from eagle3_pipeline.hf_backend import make_batches

    for turn in (1, 2):
        w = m[f"writes_batch_writer_bt256_{turn}"]["writer"]
        assert w["bytes"] == tokens * 4 * 256 * 2 and w["batches"] == len(make_batches(lengths, 256))
        assert m[f"writes_per_chunk_bt256_{turn}"]["tokens_per_second"] > 0
    assert not (tmp_path / "w").exists()


@pytest.mark.processes
def test_the_hf_backend_profile_cold_mode_times_each_batch_of_two_jobs(tmp_path):
    """--cold runs the job's loop twice and nothing else: each job lists make_batches' batches (rows,
    longest sample) with main-thread seconds that add up to no more than the job, wrote every token
    once, and records the cold-start variables it ran under. --fill-host-pool names each power-of-two
    size the batches' states take (nothing pinned on a CPU); --cold-profile adds each job's host calls."""
    import numpy as np

    out = tmp_path / "c.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/hf_backend_profile.py"), "--tiny", "--samples", "6", "--min-len", "40",
           "--max-len", "90", "--batch-tokens", "256", "--cold", str(tmp_path / "c"), "--out", str(out),
           "--fill-host-pool", "3", "--cold-profile"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"} | {"CUDA_MODULE_LOADING": "EAGER"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(out.read_text())["phases"]
    assert set(m) == {"setup", "fill_host_pool", "cold_job_bt256", "second_job_bt256", "padded_error"}
    # the jobs' attention backends, cuDNN's left out, and the first batch's states against batch 1 under them
    assert m["padded_error"]["backends"] == ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
    assert 0 < m["padded_error"]["max_rel_error_vs_batch1"] < 0.02
    rng = np.random.default_rng(0)
    lengths = []
    for _ in range(6):  # make_samples' draws
        lengths.append(int(rng.integers(40, 91)))
        rng.integers(0, 4096, size=lengths[-1])
    from eagle3_pipeline.hf_backend import make_batches

    want = [[len(b), lengths[b[0]]] for b in make_batches(lengths, 256)]
    sizes = {2 ** math.ceil(math.log2(rows * longest * 4 * 256 * 2)) for rows, longest in want}  # bf16 [B, T, 4, 256]
    assert m["fill_host_pool"] | {"seconds": 0} == {"sizes_bytes": sorted(sizes), "per_size": 3, "allocated": 0, "seconds": 0}
    for k in ("cold_job_bt256", "second_job_bt256"):
        job = m[k]
        assert [b[:2] for b in job["batches"]] == want
        assert 0 < sum(b[2] for b in job["batches"]) <= job["seconds"] + 1e-3
        assert job["writer"]["bytes"] == sum(lengths) * 4 * 256 * 2
        assert job["env"] == {"CUDA_MODULE_LOADING": "EAGER", "PYTORCH_CUDA_ALLOC_CONF": None}
        calls = {name: n for _s, name, n in job["host_top"]}
        assert calls["aten::mm"] == len(want) * 8 * 7  # q, k, v, o, gate, up, down in each of the 8 layers
    assert not (tmp_path / "c").exists()


@pytest.mark.processes
def test_the_training_profile_runs_as_documented_at_a_tiny_shape(tmp_path):
    """benchmarks/train_profile.py --synthetic tiny on CPU: train_drafter's own loop ran the steps
    asked for, the profiled ones after the skipped and warm-up ones; the labelled parts of a step
    account for its time (on a CPU nothing runs beside the loop), forward and backward most of it;
    the synthetic inputs hold the samples the seed draws."""
    import numpy as np

    out = tmp_path / "t.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/train_profile.py"), "--synthetic", "tiny", "--skip", "2", "--active", "3",
           "--work", str(tmp_path / "w"), "--out", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    rng = np.random.default_rng(0)
    tokens = 0
    for _ in range(48):  # write_synthetic's draws: a length, then that many ids
        n = int(rng.integers(40, 91))
        rng.integers(0, 2048, size=n)
        tokens += n
    assert doc["failed"] == [] and doc["inputs"]["tokens"] == tokens and doc["inputs"]["layer_ids"] == [2, 4, 5, 8]
    p = doc["profile"]
    assert p["steps"] == 6 and p["profiled_steps"] == [4, 6] and p["unprofiled_steps"] == [2, 2] and p["unprofiled_tokens_per_second"] > 0
    parts = p["host_seconds_per_step"]
    assert set(parts) == {"load", "h2d", "forward", "backward", "optimizer", "metrics"}
    assert 0.7 * p["seconds_per_step"] < sum(parts.values()) <= p["seconds_per_step"] * 1.001
    assert parts["forward"] + parts["backward"] > 0.5 * p["seconds_per_step"]
    # 3 steps of packs of at most 256 tokens, at the rate over the profiled wall time
    assert 0 < p["tokens_per_second"] * p["seconds_per_step"] * 3 <= 3 * 256
    assert (tmp_path / "w" / "train" / "drafter" / "config.json").exists()


def test_kernel_classes_count_each_kernel_once_not_again_under_the_operator_that_launched_it():
    """A profiler's averages hold an operator's CPU event (aten::mm) with its kernels' time as its
    own self device time, beside the kernel's event: only the device's events are summed."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def ev(key, us, dev, count=1, annotation=False):
        return SimpleNamespace(key=key, self_device_time_total=us, device_type=dev, count=count, is_user_annotation=annotation)

    events = [
        ev("aten::mm", 3000, DeviceType.CPU),
        ev("sm90_xmma_gemm_bf16bf16_bf16f32", 3000, DeviceType.CUDA, 4),
        ev("aten::_flash_attention_forward", 1000, DeviceType.CPU),
        ev("flash_fwd_kernel", 1000, DeviceType.CUDA, 2),
        ev("Memcpy HtoD (Pinned -> Device)", 500, DeviceType.CUDA),
        ev("Memcpy DtoH (Device -> Pinned)", 300, DeviceType.CUDA),
        ev("triton_poi_fused_add_0", 200, DeviceType.CUDA),
        ev("train_step/forward", 0, DeviceType.CPU),
        # a GPU's record_function ranges: device events spanning their kernels (an H100 profile
        # counted ProfilerStep* and train_step/forward as "other", 1.9 s of kernels in 1.1 s)
        ev("ProfilerStep*", 9000, DeviceType.CUDA, 8, annotation=True),
        ev("train_step/forward", 4000, DeviceType.CUDA, 8, annotation=True),
        ev("Optimizer.step#AdamW.step", 700, DeviceType.CUDA, 8, annotation=True),
    ]
    got = phases.kernel_classes(SimpleNamespace(key_averages=lambda: events), wall_s=0.01)
    assert got["device_seconds"] == {"matmul": 0.003, "attention": 0.001, "memcpy_dtoh": 0.0003, "memcpy_htod": 0.0005, "other": 0.0002}
    assert got["device_idle_share"] == 0.5  # 5 ms of kernels in 10 ms
    assert [k["name"] for k in got["top_kernels"]][:2] == ["sm90_xmma_gemm_bf16bf16_bf16f32", "flash_fwd_kernel"]


def test_paths_and_devices_a_script_cannot_use_are_named_before_its_first_phase(tmp_path):
    """Found by trying: an --out under a file, or --device nonsense, failed only after the first
    phase's work (its result lost); these checks run before it."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    got = phases.unwritable(
        [tmp_path / "afile" / "x.json", tmp_path / "adir", tmp_path / "new" / "deeper" / "x.json", None], [tmp_path / "afile"]
    )
    assert got == [
        f"{tmp_path / 'afile' / 'x.json'}: {tmp_path / 'afile'} is a file, not a folder; give another path",
        f"{tmp_path / 'adir'} is a folder; give a file path",
        f"{tmp_path / 'afile'} is a file; give a folder path",
    ]
    assert phases.unwritable([tmp_path / "ok.json"], [tmp_path / "w" / "x"]) == []
    assert phases.device_problems("cpu") == []
    assert phases.device_problems("nonsense")[0].startswith("--device nonsense: Expected one of cpu, cuda")
    import torch

    if not torch.cuda.is_available():
        assert phases.device_problems("cuda:0") == ["--device cuda:0: torch sees no CUDA GPU(s) here; use --device cpu"]
    import shutil

    free = shutil.disk_usage(tmp_path).free
    assert phases.short_of_disk(tmp_path / "new" / "w", free / 1.2 - 2**20, "fewer") == []  # a folder still to make
    (line,) = phases.short_of_disk(tmp_path / "new" / "w", free, "--work elsewhere")
    assert line.startswith(f"{tmp_path / 'new' / 'w'}: ") and "GiB free, the run needs" in line and line.endswith("(--work elsewhere)")


def test_range_host_seconds_reads_the_ranges_cpu_events_not_their_device_twins():
    """On a GPU a record_function range is two averaged events of one name: the CPU one with the
    host time, and a device annotation with none; an H100 profile reported 0.0 s for forward,
    backward and optimizer because the second overwrote the first."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def ev(key, cpu_us, dev):
        return SimpleNamespace(key=key, cpu_time_total=cpu_us, device_type=dev)

    labels = {"forward": "train_step/forward", "backward": "train_step/backward", "load": "train_step/load"}
    events = [
        ev("train_step/forward", 40_000, DeviceType.CPU),
        ev("train_step/forward", 0, DeviceType.CUDA),
        ev("train_step/backward", 24_000, DeviceType.CPU),
        ev("train_step/backward", 0, DeviceType.CUDA),
        ev("aten::mm", 9_000, DeviceType.CPU),
    ]
    got = phases.range_host_seconds(SimpleNamespace(key_averages=lambda: events), labels, per=8)
    assert got == {"forward": 0.005, "backward": 0.003}  # no load range recorded: no entry


@pytest.mark.processes
def test_the_hf_backend_profile_needs_only_torch_and_transformers_of_the_workflow_environment():
    """A GPU image's Python has torch and transformers but not the workflow's other packages: the
    profile's imports (hf_backend, plan.estimate_params, conventions) load with jsonschema, yaml,
    snakemake, vllm and speculators hidden."""
    code = textwrap.dedent(f"""
        import sys
        class Hide:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("jsonschema", "yaml", "snakemake", "vllm", "speculators"):
                    raise ImportError("hidden: " + name)
        sys.meta_path.insert(0, Hide())
        sys.path[:0] = [{str(ROOT / "benchmarks")!r}]
        import hf_backend_profile
        from eagle3_pipeline.conventions import resolve_layer_ids
        from eagle3_pipeline.hf_backend import BatchWriter, extract_hf, make_batches, pad_batch, prefill_batches
        from eagle3_pipeline.resume import ChunkStore
        from eagle3_pipeline.shards import ShardWriter
        from eagle3_pipeline.plan import estimate_params
        print("imports ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "imports ok" in r.stdout, r.stderr[-2000:]


@pytest.mark.processes
def test_the_quantized_hf_check_runs_as_documented_on_cpu(tmp_path):
    """benchmarks/hf_quantized.py on CPU for the fp8-tiles, W4A16 and FP8-dynamic stand-ins: the first
    two families' states are the float32 reference's within bf16 rounding at every layer, FP8
    dynamic's carry its fp8 activations' rounding (above bf16's, below its own bound; an H100 gave
    5.2-6.4%), and the JSON says so."""
    from stand_ins import MissingTokenizer, family_tokenizer

    try:
        family_tokenizer("qwen3")
    except MissingTokenizer as e:
        if os.environ.get("CI"):
            pytest.fail(f"{e} (`make test` fetches it)")
        pytest.skip(str(e))
    out = tmp_path / "q.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/hf_quantized.py"), "qwen3_fp8_blocks", "qwen3_w4a16", "qwen3_fp8",
           "--device", "cpu", "--work", str(tmp_path / "w"), "--out", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["failed"] == []
    for fam in ("qwen3_fp8_blocks", "qwen3_w4a16"):
        got = doc["phases"][fam]
        errs = list(got["rel_rms_vs_fp32_cpu_per_layer"].values())
        assert got["result"] == "passed" and got["hf_on"] == "cpu" and len(errs) == 4
        assert min(errs) > 0.001 and max(errs) < 0.02 and got["bound"] == 0.02  # bf16 rounding: above zero, below 2%
    fp8 = doc["phases"]["qwen3_fp8"]
    errs = list(fp8["rel_rms_vs_fp32_cpu_per_layer"].values())
    assert fp8["result"] == "passed" and fp8["bound"] == 0.1 and min(errs) > 0.02 and max(errs) < 0.1


@pytest.mark.processes
@pytest.mark.parametrize(
    "args, says",
    [
        (["train_profile.py", "--configfile", "no-such.yaml"], "no-such.yaml does not exist: give the run's config files"),
        (["hf_quantized.py", "qwen3_nope", "--device", "cpu"], "unknown family qwen3_nope: name one of qwen3, qwen3_moe"),
        (["hf_quantized.py", "qwen3_fp8", "--device", "nonsense"], "--device nonsense: Expected one of cpu, cuda"),
        (["train_profile.py", "--synthetic", "tiny", "--skip", "2", "--active", "0"], "--active 0: give 1 or more steps to profile"),
        (["writer_throughput.py", "--threads", "1", "0"], "--requests, --threads, --repeats and --rounds must be at least 1"),
    ],
)
def test_a_profile_script_given_a_bad_input_stops_before_its_first_phase_saying_what_to_do(tmp_path, args, says):
    out = tmp_path / "x.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / args[0]), *args[1:], "--out", str(out)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and "cannot start" in r.stderr and says in r.stderr, r.stderr[-2000:]
    assert not out.exists()  # nothing ran


def test_the_workload_benchmark_measures_the_prompt_tokens_the_plan_assumes(tmp_path, target_dir):
    """benchmarks/workload.py over the first 200 prompts of each ``prompts.turns`` set: every prompt
    counted once (kept or too long), its mean the kept prompts' tokens over their count, and that
    mean within 25% of the figure the plan uses for the whole set (references.json)."""
    from eagle3_pipeline.plan import PROMPT_TOKENS_BY_TURNS

    out = tmp_path / "w.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/workload.py"), "--tokenizer", str(target_dir), "--max-prompts", "200", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["failed"] == [] and set(doc["phases"]) == set(PROMPT_TOKENS_BY_TURNS)
    for turns, m in doc["phases"].items():
        assert m["prompts"] == 200 and m["kept"] + m["too_long"] == 200, turns
        assert m["mean_prompt_tokens"] == pytest.approx(m["prompt_tokens"] / m["kept"], abs=0.05), turns
        assert m["mean_prompt_tokens"] == pytest.approx(PROMPT_TOKENS_BY_TURNS[turns], rel=0.25), turns
        assert m["plan_uses"] == PROMPT_TOKENS_BY_TURNS[turns]
