"""A killed train_drafter resumes from its checkpoint and ends with the same weights (also when the rerun
reads its batches with loader processes).

AdamW: the checkpoint saves and restores every optimizer's ``state_dict`` the same way; Muon
(the default, which the sweep test's variant trains with) would cost ~12 s of bf16 Newton-Schulz
steps per step on a CPU without AVX-512, and this test takes 12 steps."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_support import write_random_train_inputs

from eagle3_pipeline.config import validate_config
from eagle3_pipeline.resume import kept_work

ROOT = Path(__file__).resolve().parents[1]


def _train(work: Path, target: Path, env_extra: dict | None = None, **cfg_extra) -> subprocess.CompletedProcess:
    cfg = validate_config(
        {
            "training": {
                "epochs": 2,
                "pack_tokens": 256,
                "checkpoint_every_steps": 1,
                "val_fraction": 0.2,
                "log_every_steps": 1,
                "optimizer": "adamw",
            }
            | cfg_extra
        }
    )["training"]
    code = f"""
    import logging, sys
    sys.path.insert(0, {str(ROOT / "workflow_scripts")!r})
    logging.basicConfig(level=logging.INFO)
    from eagle3_pipeline.training import train
    if __name__ == "__main__":
        s = train([{str(work.parent / "shard-00000.safetensors")!r}], {str(work.parent / "vocab")!r}, {str(target)!r},
                  {str(work / "drafter")!r}, {str(work / "train" / "metrics.jsonl")!r}, {cfg!r}, seed=0, max_seq_len=256)
        import json; print("SUMMARY", json.dumps(s))
    """
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **(env_extra or {})}, capture_output=True, text=True
    )


def test_killed_training_resumes_to_the_same_weights(tmp_path, target_dir):
    write_random_train_inputs(tmp_path, 12)

    ref, killed = tmp_path / "ref", tmp_path / "killed"
    r = _train(ref, target_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _train(killed, target_dir, {"EAGLE3_FAULT_KILL_AFTER_STEPS": "3"})
    assert r.returncode == -signal.SIGKILL
    assert not (killed / "drafter").exists() and (killed / "train" / ".checkpoint" / "state.pt").is_file()
    # each checkpoint says so in the log; an interrupted run's hint (kept_work) names the last one
    saved = re.findall(r"checkpoint at step (\d+)/(\d+) saved in (\S+): a rerun resumes from here", r.stderr)
    assert [int(x[0]) for x in saved] == [1, 2, 3] and len({x[1] for x in saved}) == 1
    total = int(saved[0][1])
    assert total == int(re.search(r"training: .* (\d+) steps \(", r.stderr).group(1))
    assert kept_work(killed) == [
        f"training checkpoint at step 3/{total} in {killed / 'train' / '.checkpoint'} (used if the training's inputs and settings are unchanged)"
    ]
    # the rerun reads its batches with 2 loader processes (the others with none) and checkpoints every
    # 2 steps: runtime settings, so it resumes; same batches, same weights
    r = _train(killed, target_dir, loader_workers=2, checkpoint_every_steps=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming training from its checkpoint at step 3/" in r.stderr
    summary = json.loads(r.stdout.split("SUMMARY ", 1)[1])
    # the killed attempt's seconds up to its checkpoint count in the total, not in this attempt's
    assert summary["resumed_from_step"] == 3 and summary["total_seconds"] > summary["seconds"] > 0
    a, b = load_file(str(ref / "drafter" / "model.safetensors")), load_file(str(killed / "drafter" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    lines_ref = [json.loads(x) for x in (ref / "train" / "metrics.jsonl").read_text().splitlines()]
    lines_got = [json.loads(x) for x in (killed / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines_got] == [x["step"] for x in lines_ref]
    assert [x.get("loss") for x in lines_got] == [x.get("loss") for x in lines_ref]
    assert not (killed / "train" / ".checkpoint").exists()


def test_a_damaged_checkpoint_is_an_error_naming_it_and_a_missing_one_a_fresh_start(tmp_path, caplog):
    import logging

    from eagle3_pipeline.io import InputError
    from eagle3_pipeline.training import TrainCheckpoint

    ckpt = TrainCheckpoint(tmp_path / ".checkpoint", "fp")
    ckpt.dir.mkdir()
    torch.save({"fingerprint": "fp", "step": 3, "weights": torch.arange(100000)}, ckpt.dir / "state.pt")
    assert ckpt.load()["step"] == 3
    data = (ckpt.dir / "state.pt").read_bytes()
    (ckpt.dir / "state.pt").write_bytes(data[: len(data) // 2])  # truncated after it was saved
    with pytest.raises(InputError, match=r"state\.pt: the training checkpoint cannot be read .*Delete .*\.checkpoint and rerun"):
        ckpt.load()
    (ckpt.dir / "state.pt").unlink()
    (ckpt.dir / "progress.json").write_text('{"step": 3}')
    with caplog.at_level(logging.WARNING):
        assert ckpt.load() is None
    assert "has progress.json but no state.pt: training starts from step 0" in caplog.text


def test_a_training_finished_by_the_job_of_a_killed_snakemake_is_kept_by_its_rerun(tmp_path, target_dir):
    """The rerun's job waits for the job its killed snakemake left (hygiene.output_lock), then finds
    that job's drafter, metrics and summary: kept when the summary names this training's fingerprint,
    trained again when it names another (other inputs or settings)."""
    from eagle3_pipeline.training import train

    write_random_train_inputs(tmp_path, 8)
    cfg = validate_config({"training": {"epochs": 1, "pack_tokens": 256, "val_fraction": 0.25, "optimizer": "adamw"}})["training"]
    out, metrics, summary_path = tmp_path / "drafter", tmp_path / "train" / "metrics.jsonl", tmp_path / "train" / "summary.json"

    def run():
        args = [str(tmp_path / "shard-00000.safetensors")], str(tmp_path / "vocab"), str(target_dir), str(out), str(metrics), cfg
        return train(*args, seed=0, max_seq_len=256, summary_path=str(summary_path))

    first = run()  # the job that outlived its snakemake; train_drafter.py writes its summary
    summary_path.write_text(json.dumps(first))
    before = {p: p.stat().st_mtime_ns for p in (metrics, out / "model.safetensors")}
    assert run() == first
    assert {p: p.stat().st_mtime_ns for p in before} == before  # nothing trained or written again
    summary_path.write_text(json.dumps(first | {"fingerprint": "0" * 64}))  # another training's outputs
    again = run()
    assert again["fingerprint"] == first["fingerprint"] and again["steps"] == first["steps"]
    assert metrics.stat().st_mtime_ns != before[metrics]


def test_a_finished_training_marked_incomplete_is_kept_by_the_rerun_start_and_taken_back(tmp_path, caplog):
    """A killed snakemake leaves a training that finished after it marked incomplete: the rerun's
    start keeps the drafter folder, metrics and summary (hard links) before Snakemake deletes
    them, and the job takes them back when its fingerprint is the summary's and the drafter's
    files are those training recorded; under another fingerprint, or with a drafter file altered
    since, it does the work again. The store is gone after each take-back."""
    import functools
    import logging
    import shutil

    from eagle3_pipeline.io import check_recorded_files, record_files
    from eagle3_pipeline.resume import ChunkStore, take_back_kept
    from eagle3_pipeline.shard_job import keep_for_rerun

    drafter, metrics, summary = tmp_path / "drafter", tmp_path / "train" / "metrics.jsonl", tmp_path / "train" / "summary.json"

    def finished() -> None:  # what training leaves
        drafter.mkdir()
        (drafter / "config.json").write_text('{"a": 1}')
        (drafter / "model.safetensors").write_bytes(b"weights" * 100)
        record_files(drafter)
        metrics.parent.mkdir(exist_ok=True)
        metrics.write_text('{"step": 1}\n')
        summary.write_text(json.dumps({"fingerprint": "fp", "steps": 2}))

    def deleted_by_snakemake() -> None:
        shutil.rmtree(drafter)
        metrics.unlink()
        summary.unlink()

    check = functools.partial(check_recorded_files, drafter, exhaustive=True)
    finished()
    assert keep_for_rerun([str(drafter), str(metrics)], str(summary), check=check)
    deleted_by_snakemake()
    assert take_back_kept([drafter, metrics], summary, "fp", check) == {"fingerprint": "fp", "steps": 2}
    assert (drafter / "model.safetensors").read_bytes() == b"weights" * 100 and metrics.read_text() == '{"step": 1}\n'
    assert check()["model.safetensors"] and not ChunkStore.dir_for(drafter).exists()
    assert take_back_kept([drafter, metrics], summary, "fp", check) is None  # nothing kept any more
    keep_for_rerun([str(drafter), str(metrics)], str(summary), check=check)
    deleted_by_snakemake()
    assert take_back_kept([drafter, metrics], summary, "other settings", check) is None
    assert not drafter.exists() and not ChunkStore.dir_for(drafter).exists()
    finished()
    keep_for_rerun([str(drafter), str(metrics)], str(summary), check=check)
    with open(drafter / "model.safetensors", "r+b") as f:  # altered in place: the kept link holds the same bytes
        f.write(b"W")
    deleted_by_snakemake()
    with caplog.at_level(logging.WARNING):
        assert take_back_kept([drafter, metrics], summary, "fp", check) is None
    assert "not taking back the kept outputs" in caplog.text and "model.safetensors" in caplog.text
    assert not drafter.exists() and not summary.exists() and not ChunkStore.dir_for(drafter).exists()
    finished()
    (drafter / "model.safetensors").write_bytes(b"other")  # altered before the rerun's start: not kept
    assert not keep_for_rerun([str(drafter), str(metrics)], str(summary), check=check)


def test_a_checkpoint_changed_after_it_was_saved_is_refused_before_it_is_loaded(tmp_path):
    """save records the SHA-256 of what torch.save wrote (hashed on the way); one flipped bit in a
    weight, which torch.load itself accepts, is refused with both hashes; a checkpoint of an
    earlier version (no state_sha256) still loads."""
    import hashlib

    from eagle3_pipeline.io import InputError
    from eagle3_pipeline.training import TrainCheckpoint

    ckpt = TrainCheckpoint(tmp_path / ".checkpoint", "fp")
    weights = torch.arange(100000, dtype=torch.float32)
    ckpt.save({"step": 8, "total_steps": 24, "epoch": 0, "tokens_seen": 100, "weights": weights})
    path = ckpt.dir / "state.pt"
    meta = json.loads((ckpt.dir / "progress.json").read_text())
    assert meta["state_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() and meta["step"] == 8
    assert torch.equal(ckpt.load()["weights"], weights)
    data = bytearray(path.read_bytes())
    at = bytes(data).index(weights[5000:5004].numpy().tobytes())  # inside the weights' bytes
    data[at + 2] ^= 0x40
    path.write_bytes(bytes(data))
    assert not torch.equal(torch.load(path, weights_only=False)["weights"], weights)  # torch.load takes it
    with pytest.raises(InputError) as e:
        ckpt.load()
    got = hashlib.sha256(bytes(data)).hexdigest()
    assert str(e.value).startswith(f"{path}: the training checkpoint's SHA-256 is {got}, not the {meta['state_sha256']} recorded")
    assert f"Delete {ckpt.dir} and rerun" in str(e.value)
    (ckpt.dir / "progress.json").write_text(json.dumps({"step": 8}))  # an earlier version's: no hash to check
    assert ckpt.load()["step"] == 8


@pytest.mark.e2e
def test_a_training_that_ends_after_its_snakemake_was_killed_is_taken_back_not_trained_again(e2e_run, tmp_path):
    """kill -9 of snakemake alone while train_drafter runs (a closed terminal, an OOM kill): the job
    lives on and ends, its outputs marked incomplete. The rerun (after `snakemake --unlock`, as
    Snakemake asks) keeps them at its start and the rerun's job takes them back: the same drafter
    and metrics files, no step trained again."""
    import shutil
    import time

    import psutil
    from e2e_support import IN_PROCESS_ENGINES, snakemake_cli

    src, _, _ = e2e_run
    wd = tmp_path / "wd"
    shutil.copytree(src, wd, symlinks=True)
    drafter, metrics = wd / "results/e2e/drafter", wd / "results/e2e/train/metrics.jsonl"
    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", "--forcerun", "train_drafter", "-s", str(ROOT / "Snakefile"),
           "-d", str(wd), "--configfile", str(wd / "small.yaml"), "--", "results/e2e/drafter"]  # fmt: skip
    snake = subprocess.Popen(
        cmd, cwd=wd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env={**os.environ, **IN_PROCESS_ENGINES}
    )
    seen = []
    try:
        for line in snake.stderr:
            seen.append(line)
            if line.startswith(("rule train_drafter", "localrule train_drafter")):
                break
        deadline = time.monotonic() + 120

        def training_jobs() -> list:
            found = []
            for p in psutil.Process(snake.pid).children(recursive=True):
                try:  # a short-lived child (a shell, a check) may end between listing and reading
                    if "train_drafter" in " ".join(p.cmdline()):
                        found.append(p)
                except psutil.NoSuchProcess:
                    pass
            return found

        while not (job := training_jobs()):
            assert snake.poll() is None and time.monotonic() < deadline, "".join(seen)[-3000:]
            time.sleep(0.05)
    finally:
        snake.kill()  # snakemake alone: its job lives on
        snake.wait()
    psutil.wait_procs(job, timeout=600)
    assert "train:" in (wd / "logs/e2e/train_drafter.log").read_text()  # it trained, its snakemake gone
    summary = json.loads((wd / "results/e2e/train/summary.json").read_text())
    before = {p: (p.stat().st_ino, p.read_bytes()) for p in (drafter / "model.safetensors", metrics)}
    assert snakemake_cli(wd, wd / "small.yaml", "--unlock", cwd=wd).returncode == 0
    r = snakemake_cli(wd, wd / "small.yaml", "--cores", "2", targets=("results/e2e/drafter",), cwd=wd, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "kept for their jobs, which take them back" in r.stderr and "train_drafter" in r.stderr, r.stderr[-3000:]
    log = (wd / "logs/e2e/train_drafter.log").read_text()  # the rerun's job's alone (Snakemake replaced the log)
    assert "taken back from" in log and "train:" not in log, log[-3000:]
    assert {p: (p.stat().st_ino, p.read_bytes()) for p in before} == before  # the finished job's files, not new ones
    assert json.loads((wd / "results/e2e/train/summary.json").read_text()) == summary
