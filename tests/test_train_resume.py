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
    # the rerun reads its batches with 2 loader processes (the others with none): same batches, same weights
    r = _train(killed, target_dir, loader_workers=2)
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
