import numpy as np
import pytest

from eagle3_pipeline.conventions import default_aux_layer_ids, loss_mask, resolve_layer_ids


def test_default_aux_ids_match_speculators(target_dir, tmp_path):
    import json

    from speculators.models.utils import resolve_target_layer_ids

    assert default_aux_layer_ids(30) == [2, 15, 27] == resolve_target_layer_ids(None, str(target_dir))
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "config.json").write_text(
        json.dumps({"model_type": "llama", "num_hidden_layers": 61, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100})
    )
    assert default_aux_layer_ids(61) == [2, 30, 58] == resolve_target_layer_ids(None, str(deep))


def test_resolve_layer_ids_appends_final_layer():
    assert resolve_layer_ids(None, 30) == ([2, 15, 27], [2, 15, 27, 30])
    assert resolve_layer_ids([0, 5], 30) == ([0, 5], [0, 5, 30])


@pytest.mark.parametrize("bad", [[30], [-1], [2, 2], [31], []])
def test_resolve_layer_ids_rejects_out_of_range(bad):
    with pytest.raises(ValueError):
        resolve_layer_ids(bad, 30)


def test_loss_mask_boundary():
    m = loss_mask(5, 3)
    assert m.dtype == np.bool_
    assert m.tolist() == [False] * 5 + [True] * 3
    assert int(m.argmax()) == 5  # first supervised position = first completion token


def test_loss_mask_empty_completion_is_an_error():
    with pytest.raises(ValueError, match="sum to 0"):
        loss_mask(5, 0)


@pytest.mark.parametrize(
    "family",
    ["smollm2", "qwen3", "gemma3_text", "mistral", "qwen3_moe", "deepseek_v3"],
)
def test_the_draft_decoder_config_is_speculators_default_draft(tmp_path, target_dir, family):
    """Our draft layer config equals the one ``speculators train`` builds by default (its CLI helper, not
    public API: compared here while it exists) for the embedded target and small configs of other families,
    but for the activation: speculators copies the target's, and vLLM's Llama draft layer refuses any but
    SiLU, so a Gemma target's drafter gets SiLU (its GELU drafter failed to load in vLLM)."""
    import warnings

    from transformers import AutoConfig

    from eagle3_pipeline.training import draft_decoder_config

    reference = pytest.importorskip("speculators.train.cli").create_transformer_layer_config
    if family == "smollm2":
        path = str(target_dir)
    else:
        small = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}
        small |= {
            "deepseek_v3": {"q_lora_rank": 64, "kv_lora_rank": 32},
            "gemma3_text": {"head_dim": 96},  # a rope per layer type
            "mistral": {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 64},  # heads from head_dim
        }.get(family, {})
        AutoConfig.for_model(family, **small).save_pretrained(tmp_path)
        path = str(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = reference(path, 2, "llama", None, 4096, [0, 1]).to_dict()
    got = draft_decoder_config(path, 2, 4096).to_dict()
    if family == "gemma3_text":
        assert want["hidden_act"] == "gelu_pytorch_tanh" and got["hidden_act"] == "silu"
        want["hidden_act"] = "silu"
    assert got == want


def test_default_aux_ids_of_a_shallow_target_are_an_error_naming_the_setting():
    """[2, n//2, n-3] is three ascending layers from n = 7 on; 6 layers would give [2, 3, 3]."""
    assert default_aux_layer_ids(7) == [2, 3, 4]
    for n in (4, 5, 6):
        with pytest.raises(ValueError, match=rf"of a {n}-layer target are .* set extraction.aux_layer_ids"):
            default_aux_layer_ids(n)
