"""Aux layer choice: stored layers ascending (vLLM's order), a drafter on a subset of them (training.aux_layer_ids)."""

import json

import numpy as np
import pytest
import torch

from eagle3_pipeline.config import ConfigError, check_against_target, validate_config
from eagle3_pipeline.conventions import drafter_aux_columns, loss_mask, resolve_layer_ids
from eagle3_pipeline.io import save_npy_atomic
from eagle3_pipeline.shards import Sample, ShardReader, write_shard
from eagle3_pipeline.training import ShardDataset, split_items, train
from eagle3_pipeline.vocab import build_mapping

STORED = [2, 8, 15, 22, 27]  # aux layers of a superset extraction of the 30-layer target


def test_aux_layer_ids_must_be_ascending_as_vllm_concatenates_them():
    with pytest.raises(ValueError, match=r"ascending .*write \[2, 15, 27\]"):
        resolve_layer_ids([27, 2, 15], 30)
    assert resolve_layer_ids(STORED, 30) == (STORED, STORED + [30])


def test_a_drafter_takes_a_subset_of_the_stored_aux_layers():
    assert drafter_aux_columns(None, [2, 15, 27]) == ([2, 15, 27], [0, 1, 2])
    assert drafter_aux_columns([8, 22], STORED) == ([8, 22], [1, 3])
    assert drafter_aux_columns([2, 15, 27], STORED) == ([2, 15, 27], [0, 2, 4])
    with pytest.raises(ValueError, match=r"\[9\] are not in the hidden states, which hold \[2, 8, 15, 22, 27\]: add them to extraction"):
        drafter_aux_columns([2, 9], STORED)
    with pytest.raises(ValueError, match="ascending"):
        drafter_aux_columns([22, 8], STORED)


def test_the_config_check_names_a_drafter_layer_that_is_not_extracted():
    check_against_target(validate_config({"extraction": {"aux_layer_ids": STORED}, "training": {"aux_layer_ids": [8, 22]}}), 30, 49152)
    with pytest.raises(ConfigError, match=r"training.aux_layer_ids: aux layer ids \[8\] are not in the hidden states"):
        check_against_target(validate_config({"training": {"aux_layer_ids": [2, 8]}}), 30, 49152)  # default [2, 15, 27] stored
    with pytest.raises(ConfigError, match="extraction.aux_layer_ids: aux layer ids must be ascending"):
        check_against_target(validate_config({"extraction": {"aux_layer_ids": [15, 2, 27]}}), 30, 49152)


def test_aux_id_0_is_refused_at_the_start_for_deepseek_family_targets_only():
    """vLLM's DeepSeek-V2/V3 (and Kimi-K2) class cannot capture layer 0's input: a config asking it is an error
    naming the key before any job runs; Llama's capture takes it, and the hf backend may store it when the
    drafter, which vLLM evaluates, leaves it out."""
    with_0 = {"aux_layer_ids": [0, 15, 27]}
    vllm = validate_config({"extraction": {"backend": "vllm", **with_0}})
    with pytest.raises(ConfigError) as e:
        check_against_target(vllm, 61, 163840, "deepseek_v3")
    msg = str(e.value)
    assert "extraction.aux_layer_ids: aux layer id 0 (in [0, 15, 27]) cannot be captured by vLLM's deepseek_v3" in msg
    assert "training.aux_layer_ids: the drafter's aux layer id 0" in msg and "ids of 1 or more" in msg
    hf = validate_config({"extraction": {"backend": "hf", **with_0}})
    with pytest.raises(
        ConfigError, match=r"^invalid configuration for this target:\n  training.aux_layer_ids: the drafter's aux layer id 0"
    ):
        check_against_target(hf, 61, 163840, "kimi_k2")
    check_against_target(validate_config({"extraction": with_0, "training": {"aux_layer_ids": [15, 27]}}), 61, 163840, "deepseek_v3")
    check_against_target(vllm, 30, 49152, "llama")
    check_against_target(vllm, 30, 49152)  # model type not known: nothing to check
    check_against_target(validate_config({"extraction": {"backend": "vllm"}}), 61, 163840, "deepseek_v3")  # [2, 30, 58]


def test_the_model_type_is_read_from_the_language_model_config(tmp_path):
    from eagle3_pipeline.target_model import BUILTIN_TARGET, configured_target_model_type

    assert configured_target_model_type(BUILTIN_TARGET) == "llama"
    for name, cfg in {
        "kimi": {"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2"}},
        "dsv3": {"model_type": "deepseek_v3"},
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        (tmp_path / name / "model.safetensors").write_bytes(b"")  # what a target directory must hold
        (tmp_path / name / "chat_template.jinja").write_text("{{ messages }}")
    assert configured_target_model_type(str(tmp_path / "kimi")) == "kimi_k2"
    assert configured_target_model_type(str(tmp_path / "dsv3")) == "deepseek_v3"


def _superset_shard(d, num_samples=12):
    """A shard of random SmolLM2-shaped states at layers STORED + [30], and a 512-token draft vocab."""
    rng = np.random.default_rng(1)
    samples, states = [], []
    for i in range(num_samples):
        n_p, n_c = int(rng.integers(10, 40)), int(rng.integers(20, 60))
        samples.append(Sample(f"{i:016x}", rng.integers(0, 600, size=n_p + n_c), loss_mask(n_p, n_c)))
        states.append(torch.randn(n_p + n_c, len(STORED) + 1, 576, dtype=torch.bfloat16))
    shard = d / "shard-00000.safetensors"
    write_shard(shard, samples, states, layer_ids=STORED + [30], aux_layer_ids=STORED, index_path=d / "shard-00000.index.json")
    counts = np.zeros(49152, dtype=np.int64)
    counts[:600] = 1
    d2t, t2d = build_mapping(counts, 512)
    save_npy_atomic(d / "vocab" / "d2t.npy", d2t)
    save_npy_atomic(d / "vocab" / "t2d.npy", t2d)
    return shard, states


def test_training_samples_carry_exactly_the_chosen_layers(tmp_path):
    shard, states = _superset_shard(tmp_path)
    reader = ShardReader(shard)
    items, _ = split_items([reader], 0.0)
    _, cols = drafter_aux_columns([8, 22], reader.aux_layer_ids)
    ds = ShardDataset([reader], items, 4096, torch.bfloat16, cols)
    for n, (_, i) in enumerate(items[:3]):
        got = ds[n]
        want = torch.cat([states[i][:, 1], states[i][:, 3]], dim=-1)  # layers 8 and 22, in that order
        assert torch.equal(got["hidden_states"], want)
        assert torch.equal(got["verifier_last_hidden_states"], states[i][:, 5])  # the final layer (30)
    every = ShardDataset([reader], items, 4096, torch.bfloat16)[0]["hidden_states"]  # no choice: all stored aux layers
    assert torch.equal(every, states[items[0][1]][:, :5].reshape(-1, 5 * 576))


def test_fp8_training_samples_dequantize_only_the_chosen_layers_to_the_same_values(tmp_path):
    """An fp8 shard read for a subset: each chosen row is q x its row scale, computed here from the raw tensors."""
    shard, states = _superset_shard(tmp_path)
    f8 = tmp_path / "fp8.safetensors"
    bf = ShardReader(shard)
    samples = [Sample(sid, bf.sample(i)["input_ids"].numpy(), bf.sample(i)["loss_mask"].numpy()) for i, sid in enumerate(bf.sample_ids)]
    write_shard(f8, samples, states, layer_ids=STORED + [30], aux_layer_ids=STORED, index_path=None, storage_dtype=torch.float8_e4m3fn)
    reader = ShardReader(f8)
    q, scale = reader.raw("hidden_states"), reader.raw("hidden_states_scale")  # [N, 6, 576] fp8, [N, 6] float32
    items, _ = split_items([reader], 0.0)
    _, cols = drafter_aux_columns([8, 22], reader.aux_layer_ids)
    ds = ShardDataset([reader], items, 4096, torch.bfloat16, cols)
    for n, (_, i) in enumerate(items[:3]):
        a, b = int(reader.offsets[i]), int(reader.offsets[i + 1])
        rows = [(q[a:b, k].float() * scale[a:b, k, None]).to(torch.bfloat16) for k in (1, 3, 5)]  # layers 8, 22, 30
        got = ds[n]
        assert torch.equal(got["hidden_states"], torch.cat(rows[:2], dim=-1))
        assert torch.equal(got["verifier_last_hidden_states"], rows[2])
        assert torch.equal(reader.sample(i, layers=[3, 1])["hidden_states"], reader.sample(i)["hidden_states"][:, [3, 1]])


def test_a_drafter_trained_on_a_subset_names_those_layers(tmp_path, target_dir):
    shard, _ = _superset_shard(tmp_path)
    training = {"epochs": 1, "pack_tokens": 256, "val_fraction": 0.2, "aux_layer_ids": [2, 15, 27], "optimizer": "adamw"}
    cfg = validate_config({"training": training})["training"]  # AdamW: Muon's bf16 steps are slow on CPU
    out = tmp_path / "drafter"
    summary = train(
        [str(shard)], str(tmp_path / "vocab"), str(target_dir), str(out), str(tmp_path / "m.jsonl"), cfg, seed=0, max_seq_len=256
    )
    assert summary["aux_layer_ids"] == [2, 15, 27]
    assert json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    from safetensors.torch import load_file

    assert load_file(str(out / "model.safetensors"))["fc.weight"].shape == (576, 3 * 576)  # three layers in, not five


def test_the_layers_example_compares_stored_subsets_against_the_default():
    from pathlib import Path

    import yaml
    from snakemake.utils import update_config

    from eagle3_pipeline.sweep import changes, variant_configs

    root = Path(__file__).resolve().parents[1]
    merged = yaml.safe_load((root / "config/examples/smollm2-h200.yaml").read_text())  # as two --configfile files
    update_config(merged, yaml.safe_load((root / "config/examples/smollm2-h200-layers.yaml").read_text()))
    cfg = validate_config(merged)
    check_against_target(cfg, 30, 49152)
    assert cfg["training"]["aux_layer_ids"] == [2, 15, 27] and cfg["extraction"]["storage_dtype"] == "float8_e4m3fn"
    assert cfg["training"]["epochs"] == 4 and cfg["extraction"]["backend"] == "vllm"  # the H200 example's own settings kept
    variants = variant_configs(cfg)
    for v in variants.values():
        check_against_target(v, 30, 49152)
    assert {n: changes(cfg, v) for n, v in variants.items()} == {
        "mid": {"training.aux_layer_ids": [8, 15, 22]},
        "wide": {"training.aux_layer_ids": [2, 8, 15, 22, 27]},
        "late": {"training.aux_layer_ids": [15, 22, 27]},
        "vocab8k": {"vocab.draft_vocab_size": 8192},
        "epochs2": {"training.epochs": 2},
    }
