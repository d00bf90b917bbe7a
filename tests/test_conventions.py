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
