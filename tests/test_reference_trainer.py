"""benchmarks/reference_trainer.py: our shards as speculators' trainer reads them, and its command line."""

import sys
from pathlib import Path

import pytest
import torch
from train_support import write_random_train_inputs

from eagle3_pipeline.config import validate_config
from eagle3_pipeline.shards import ShardReader
from eagle3_pipeline.training import ShardDataset, split_items

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import reference_trainer  # noqa: E402


@pytest.mark.parametrize("aux_layer_ids", [None, [2, 27]])
def test_speculators_reads_the_samples_train_drafter_reads_with_the_same_split(tmp_path, aux_layer_ids):
    from speculators.train.data import ArrowDataset

    shard = write_random_train_inputs(tmp_path, 12)  # layers [2, 15, 27, 30], aux [2, 15, 27]
    info = reference_trainer.export_for_speculators([str(shard)], 0.25, aux_layer_ids, tmp_path / "data")
    readers = [ShardReader(shard)]
    train, val = split_items(readers, 0.25)
    assert val and info["train"] == len(train) and info["val"] == len(val) and info["samples"] == 12
    assert info["aux_layer_ids"] == (aux_layer_ids or [2, 15, 27])
    assert int(info["samples"] * info["train_data_ratio"]) == len(train)  # speculators' own split expression
    columns = None if aux_layer_ids is None else [[2, 15, 27].index(i) for i in aux_layer_ids]
    for split, items in (("train", train), ("val", val)):
        theirs = ArrowDataset(4096, tmp_path / "data", split=split, train_ratio=info["train_data_ratio"], on_missing="raise")
        ours = ShardDataset(readers, items, 4096, torch.bfloat16, columns)
        assert len(theirs) == len(ours) == len(items)
        for j in range(len(items)):
            a, b = theirs[j], ours[j]
            assert set(b) <= set(a)
            for key in b:
                assert torch.equal(a[key], b[key]), (split, j, key)
        assert [info["ids"][theirs._map_to_file_idx(j)] for j in range(len(items))] == [readers[0].sample_ids[i] for _, i in items]


def test_the_speculators_command_carries_the_runs_settings_and_its_own_defaults(tmp_path):
    from speculators.train.config import TrainConfig

    cfg = validate_config({"seed": 7, "training": {"epochs": 5, "ttt_steps": 4, "ttt_step_loss_decay": 0.8}})
    write_random_train_inputs(tmp_path, 2)
    cmd = reference_trainer.speculators_command(
        cfg, "/models/t", tmp_path / "data", tmp_path / "vocab", [2, 15, 27], 0.875, tmp_path / "s", True
    )
    assert cmd[1:4] == ["-m", "speculators", "train"]
    got = TrainConfig.resolve(cmd[4:])  # the trainer's own parser and validation
    default = TrainConfig.resolve(["--verifier-name-or-path", "/models/t"])
    assert (got.trainer.epochs, got.loss.ttt_steps, got.loss.ttt_step_loss_decay, got.seed) == (5, 4, 0.8, 7)
    assert got.draft.target_layer_ids == [2, 15, 27] and got.draft.draft_vocab_size == 512
    assert got.draft.d2t_path == str(tmp_path / "vocab" / "d2t.npy") and got.data.train_data_ratio == 0.875
    assert got.loss.loss_implementation == "eager" and default.loss.loss_implementation == "fused"
    # what the comparison leaves to the reference trainer: its own optimizer, schedule, loss and packing
    for group, field in (("optimizer", "optimizer"), ("optimizer", "lr"), ("scheduler", "scheduler_type"), ("data", "total_seq_len")):
        assert getattr(getattr(got, group), field) == getattr(getattr(default, group), field), field
    assert got.loss.loss_fn == default.loss.loss_fn
