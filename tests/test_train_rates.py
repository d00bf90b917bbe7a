"""train_drafter's throughput figures: ``steady_tokens_per_second`` is the optimizer steps' own rate after
warm-up, without the validation pass and checkpoints between them (what ``benchmarks/vs_speculators.py``
compares with speculators' per-step timing), and the seconds left out are reported beside it."""

import time

import pytest
from train_support import write_random_train_inputs

from eagle3_pipeline import training
from eagle3_pipeline.config import validate_config


def test_the_steady_rate_leaves_out_validation_and_checkpoints(tmp_path, target_dir, monkeypatch):
    write_random_train_inputs(tmp_path, 40)
    cfg = validate_config(
        {"training": {"epochs": 1, "pack_tokens": 256, "val_fraction": 0.1, "optimizer": "adamw", "checkpoint_every_steps": 3}}
    )["training"]
    slow = {"validation": 1.5, "checkpoint": 0.4}
    spent = {"validation": [], "checkpoint": []}

    def timed(kind, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            # a validation pass that compiles, a checkpoint on a slow disk; the validation (after the last
            # step) lasts at least 0.4x the steps' time, so that counting it in shows on a slow machine too
            steps_s = after_step[-1][0] - after_step[0][0] if kind == "validation" and after_step else 0.0
            time.sleep(max(slow[kind], 0.4 * steps_s))
            out = fn(*args, **kwargs)
            spent[kind].append((t0, time.perf_counter()))
            return out

        return wrapper

    monkeypatch.setattr(training, "evaluate_offline", timed("validation", training.evaluate_offline))
    monkeypatch.setattr(training.TrainCheckpoint, "save", timed("checkpoint", training.TrainCheckpoint.save))
    after_step = []  # (time, tokens seen) as each optimizer step ends

    s = training.train(
        [str(tmp_path / "shard-00000.safetensors")], str(tmp_path / "vocab"), str(target_dir), str(tmp_path / "drafter"),
        str(tmp_path / "train" / "metrics.jsonl"), cfg, seed=0, max_seq_len=256,
        step_callback=lambda step, tokens: after_step.append((time.perf_counter(), tokens)),
    )  # fmt: skip
    steps = s["steps"]
    assert steps >= 10 and len(after_step) == steps and len(spent["validation"]) == 1
    # independently: from the warm-up step's end (the first 10% of the steps) to the last step's end, less
    # the checkpoints taken in between; the validation pass comes after the last step
    warm = max(1, steps // 10)
    (t_warm, tok_warm), (t_last, tok_last) = after_step[warm - 1], after_step[-1]
    between = sum(b - a for a, b in spent["checkpoint"] if t_warm <= a <= t_last)
    assert between >= slow["checkpoint"] * 2  # checkpoints every 3 steps fall inside the window
    expected = (tok_last - tok_warm) / (t_last - t_warm - between)
    assert s["steady_tokens_per_second"] == pytest.approx(expected, rel=0.1)
    # what the figure used to count in would have cut it by more than the test's tolerance
    validation_s = sum(b - a for a, b in spent["validation"])
    assert (tok_last - tok_warm) / (t_last - t_warm + validation_s) < expected / 1.2
    assert s["validation_seconds"] == pytest.approx(validation_s, abs=0.05)
    assert s["checkpoint_seconds"] == pytest.approx(sum(b - a for a, b in spent["checkpoint"]), abs=0.05)
    assert s["tokens_per_second"] < s["steady_tokens_per_second"]  # the whole loop's rate keeps them in
