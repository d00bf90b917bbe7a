"""Quantized targets for the tests: a bf16 checkpoint quantized with compressed-tensors' public API
(the format of llm-compressor's releases, Kimi-K2.5's W4A16 among them), and the float32 reference
its states are compared with."""

from pathlib import Path

import torch


def quantize(src: Path, dest: Path, weights: dict) -> Path:
    """The target at ``src`` quantized to compressed-tensors with the weight scheme ``weights``
    (``QuantizationArgs`` fields), written to ``dest`` with its tokenizer: every ``Linear`` but
    ``lm_head`` (embeddings and norms stay bf16, as in quantized releases), min-max scales (no
    calibration: weights are random), integer weights packed (``pack-quantized``), fp8 ones stored
    as ``float8_e4m3fn`` (``float-quantized``). Fp8 weights get fp8 per-token activations, as in
    llm-compressor's FP8_DYNAMIC; integer weights keep bf16 activations (W4A16). The tokenizer is
    copied where ``src`` has one."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    wargs = QuantizationArgs(**weights)
    fp8 = wargs.type == "float"
    acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True) if fp8 else None
    scheme = QuantizationScheme(targets=["Linear"], weights=wargs, input_activations=acts)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        w = module.weight.detach().float()
        if wargs.strategy == "group":
            w = w.reshape(w.shape[0], -1, wargs.group_size)
        scale, zero_point = calculate_qparams(w.amin(-1), w.amax(-1), wargs)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized" if fp8 else "pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(dest)
    compressor.update_config(dest)
    if (src / "tokenizer_config.json").is_file():
        transformers.AutoTokenizer.from_pretrained(src).save_pretrained(dest)
    return dest


def dequantized_fp32(target: Path):
    """A float32 model of ``target`` computing as its checkpoint prescribes: quantized weights
    dequantized (transformers' ``run_compressed=False``), and where the scheme quantizes activations
    (fp8 per token, dynamic), each quantized layer's input rounded to float8_e4m3fn with a scale per
    token of max|x| / 448 (written here, independently of both backends' kernels). The reference a
    quantized target's states are compared with. An unquantized target, or one in the fp8 format of
    :func:`quantize_fp8_blocks`, is loaded in float32 (transformers dequantizes the latter's
    weights as it loads on a CPU, and leaves its activations unquantized)."""
    import transformers

    from eagle3_pipeline.hf_backend import load_hf_target

    config = transformers.AutoConfig.from_pretrained(target)
    quantization = getattr(config, "quantization_config", None)
    if quantization is None or quantization["quant_method"] != "compressed-tensors":
        # transformers dequantizes the fp8 release format as it loads on a CPU (activations unquantized)
        return load_hf_target(str(target), "cpu").float()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        target, dtype=torch.bfloat16, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False)
    )
    acts = [g.get("input_activations") for g in config.quantization_config["config_groups"].values()]
    del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(
        {
            k: v.float()
            for k, v in loaded.state_dict().items()
            if not k.rsplit(".", 1)[-1].startswith(("weight_scale", "weight_shape", "weight_zero_point", "input_"))
        },
        strict=False,
    )
    assert not missing, missing
    if any(acts):
        assert acts[0] == acts[0] | {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}, acts

        def fp8_per_token(module, args):
            x = args[0]
            scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
            return ((x / scale).to(torch.float8_e4m3fn).float() * scale,)

        quantized = {k.rsplit(".", 1)[0] for k in loaded.state_dict() if k.endswith(".weight_scale")}
        for name, module in model.named_modules():
            if name in quantized:
                module.register_forward_pre_hook(fp8_per_token)
    return model.eval()


def quantize_fp8_blocks(src: Path, dest: Path, block: int = 128) -> Path:
    """The target at ``src`` in the fp8 format of DeepSeek-V3's and Qwen3's own FP8 releases
    (``quant_method: fp8``, not compressed-tensors), written to ``dest``: every 2-D ``*.weight``
    but the embeddings and ``lm_head`` as ``float8_e4m3fn`` with one float32 ``weight_scale_inv``
    (max|w| / 448, the multiplier that restores the weight) per ``block`` x ``block`` tile, and
    activations quantized dynamically by the engine. Other files are copied."""
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(src, dest)
    out = {}
    for key, w in load_file(src / "model.safetensors").items():
        if key.endswith(".weight") and w.ndim == 2 and "embed" not in key and "lm_head" not in key:
            rows, cols = w.shape
            tiles = w.float().reshape(rows // block, block, cols // block, block)
            scale = tiles.abs().amax((1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
            out[key] = (tiles / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
            out[key + "_scale_inv"] = scale.contiguous()
        else:
            out[key] = w
    return _write_quantized(
        dest,
        out,
        {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [block, block],
        },
    )


#: The attention and expert projections a W4A16 mixture of experts quantizes (Kimi-K2.5's routed
#: experts and attention; its router, embeddings, norms and lm_head stay bf16).
MOE_W4A16_WEIGHTS = r".*(self_attn\.[qkvo]_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight$"


def quantize_moe_w4a16(src: Path, dest: Path, group_size: int = 32) -> Path:
    """A mixture-of-experts target at ``src`` (a checkpoint with one tensor per expert, as
    transformers saves them) quantized to compressed-tensors W4A16 the way Kimi-K2.5 is: 4-bit
    symmetric integer weights in groups of ``group_size`` along the input dimension, packed
    (``pack-quantized``: ``weight_packed``, ``weight_scale``, ``weight_shape``) for every tensor
    :data:`MOE_W4A16_WEIGHTS` matches, each expert's projections on their own. Written by hand per
    tensor with compressed-tensors' compressor, because its model-level API targets ``Linear``
    modules and transformers 5 holds a layer's experts as one fused 3-D parameter. The router
    (``mlp.gate``) and ``lm_head`` are ignored, as in quantized releases; other files are copied."""
    import re
    import shutil

    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file

    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("model.safetensors"))
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    out, pattern = {}, re.compile(MOE_W4A16_WEIGHTS)
    for key, w in load_file(src / "model.safetensors").items():
        if not pattern.match(key):
            out[key] = w
            continue
        groups = w.float().reshape(w.shape[0], -1, group_size)
        scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), weights)
        packed = PackedQuantizationCompressor.compress(
            {"weight": w, "weight_scale": scale.to(w.dtype), "weight_zero_point": zero_point}, scheme
        )
        out.update({key.removesuffix("weight") + name: t.contiguous() for name, t in packed.items()})
    return _write_quantized(
        dest,
        out,
        {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {"targets": ["Linear"], "format": "pack-quantized", "weights": weights.model_dump(), "input_activations": None}
            },
            "ignore": ["lm_head", "re:.*mlp.gate$"],
        },
    )


def fake_quantized_int4(w: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """``w`` as symmetric 4-bit integers in groups of ``group_size`` along its last dimension make it,
    in float32: scale = max|group| / 7.5 in ``w``'s dtype, q = clamp(round(w / scale), -8, 7) with the
    division in ``w``'s dtype (as the quantizer divides a bf16 checkpoint), w' = q x scale. The
    W4A16 arithmetic written here independently of compressed-tensors and transformers, for a
    reference the hf backend's dequantized weights are checked against."""
    groups = w.reshape(*w.shape[:-1], -1, group_size)
    scale = (groups.float().abs().amax(-1, keepdim=True) / 7.5).to(w.dtype).clamp(min=torch.finfo(w.dtype).tiny)
    q = (groups / scale).float().round().clamp(-8, 7)
    return (q * scale.float()).reshape(w.shape)


def _write_quantized(dest: Path, tensors: dict, quantization_config: dict) -> Path:
    """``tensors`` as ``dest``'s model.safetensors, and ``quantization_config`` added to the
    config.json already in ``dest``: the last step of each hand-written quantized checkpoint."""
    import json

    from safetensors.torch import save_file

    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest
