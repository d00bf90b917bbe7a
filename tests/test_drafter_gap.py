"""benchmarks/drafter_gap.py's offline forward of one sequence, as the ``tensors`` row runs it."""

import sys

import numpy as np
import pytest
import torch
from e2e_support import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.parametrize("attn", ["sdpa", "simple_flex_attention"])
def test_one_document_padded_to_flex_blocks_drafts_as_the_bare_sequence(target_dir, attn):
    """A 117-token sequence (116 rows, not a multiple of 128) padded as training's packs are: the
    drafter's logits on its rows equal those of the unpadded sequence under sdpa, with sdpa and with
    flex attention (which rejected the bare sequence on an H200: a block mask of 128 rows given 116)."""
    from drafter_gap import one_document_batch

    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.training import build_drafter
    from eagle3_pipeline.vocab import build_mapping

    counts = np.zeros(49152, dtype=np.int64)
    counts[100:400] = np.arange(300, 0, -1)
    d2t, t2d = build_mapping(counts, 256)
    cfg = validate_config({})["training"] | {"max_seq_len_hint": 512}
    torch.manual_seed(0)
    seq = torch.randint(100, 400, (117,)).tolist()
    h = torch.randn(117, 3 * 576)

    def logits(attn_impl: str, batch: dict) -> torch.Tensor:
        torch.manual_seed(1)
        model = build_drafter(str(target_dir), d2t, t2d, [2, 15, 27], cfg | {"attn_implementation": attn_impl}, "cpu").eval()
        out = []
        hook = model.lm_head.register_forward_hook(lambda _m, _i, o: out.append(o.detach()[0]))
        with torch.no_grad():
            model(**batch, ttt_steps=2)
        hook.remove()
        return torch.stack(out)  # [ttt steps, rows, draft vocab]

    padded = one_document_batch(h, seq)
    assert padded["input_ids"].shape == (1, 128) and padded["document_ids"][0, 116:].eq(-1).all()
    bare = {k: v[:, :116] for k, v in padded.items()}
    want = logits("sdpa", bare)
    got = logits(attn, padded)[:, :116]
    if attn == "simple_flex_attention":  # what the H200 run hit without the padding
        with pytest.raises(ValueError, match="block_mask was created for"):
            logits(attn, bare)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def test_genuine_rows_stop_at_stale_padding_and_rejected_drafts():
    from drafter_gap import genuine_rows

    seq = [9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511]
    # prefill: rows 0..7 feed seq[1..8]; the next call starts at position 8
    assert genuine_rows(seq[1:9], list(range(8)), seq, 8) == list(range(8))
    # a decode call as vLLM 0.26 makes it on an H200: row 0 real, rows 1-3 stale copies of the
    # prompt's start whose ids equal the true tokens there (the measurement counted them)
    assert genuine_rows([seq[5], seq[2], seq[3], seq[4]], [4, 1, 2, 3], seq, 5) == [0]
    # two accepted drafts, then a rejected one whose id happens to be right
    assert genuine_rows([seq[5], seq[6], seq[7], seq[8]], [4, 5, 6, 7], seq, 7) == [0, 1, 2]
    # the last call (no next one): consecutive rows while the ids match
    assert genuine_rows([seq[8], seq[9]], [7, 8], seq, None) == [0, 1]
    assert genuine_rows([seq[8], 0], [7, 8], seq, None) == [0]
    assert genuine_rows([0, seq[9]], [7, 8], seq, None) == []
