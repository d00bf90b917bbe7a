"""Compute dtypes: ``auto`` is bf16 where the hardware runs it and float32 on CPUs that emulate it."""

import platform
import sys
from pathlib import Path

import pytest
import torch

from eagle3_pipeline import precision
from eagle3_pipeline.config import validate_config
from eagle3_pipeline.training import training_dtypes


@pytest.fixture(params=[False, True], ids=["cpu-without-fast-bf16", "cpu-with-fast-bf16"])
def fast_bf16(request, monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: request.param)
    return request.param


def test_auto_is_float32_only_on_a_cpu_without_fast_bf16(fast_bf16):
    assert precision.resolve_dtype("auto", "cpu", "x") == (None if fast_bf16 else "float32")
    for gpu in ("cuda", "cuda:1"):
        assert precision.resolve_dtype("auto", gpu, "x") is None  # the checkpoint's dtype
    for explicit in ("bfloat16", "float16", "float32"):
        assert precision.resolve_dtype(explicit, "cpu", "x") == explicit == precision.resolve_dtype(explicit, "cuda", "x")


def test_the_fast_bf16_test_is_onednns_avx512_core_condition():
    """oneDNN runs bf16 in its kernels on x86 with AVX-512 F, BW, VL and DQ (``avx512_core``) or
    with AVX-VNNI, AVX-VNNI-INT8 and AVX-NE-CONVERT (``avx2_vnni_2``): its ``has_data_type_support``."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("reads /proc/cpuinfo of an x86 Linux host")
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    expected = all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq")) or all(
        f in flags for f in ("avx_vnni", "avx_vnni_int8", "avx_ne_convert")
    )
    assert precision.cpu_has_fast_bf16() is expected


def test_training_dtypes_follow_the_hardware_unless_given(fast_bf16):
    cfg = validate_config({})["training"]
    assert (cfg["hidden_states_dtype"], cfg["autocast"]) == ("auto", "auto")  # the defaults
    want = (torch.bfloat16, torch.bfloat16) if fast_bf16 else (torch.float32, None)
    assert training_dtypes(cfg, "cpu") == want
    assert training_dtypes(cfg, "cuda:0") == (torch.bfloat16, torch.bfloat16)
    given = cfg | {"hidden_states_dtype": "bfloat16", "autocast": "none"}
    assert training_dtypes(given, "cpu") == training_dtypes(given, "cuda") == (torch.bfloat16, None)


def test_the_vllm_engine_gets_float32_only_when_auto_meets_slow_bf16(fast_bf16, monkeypatch):
    import vllm

    from eagle3_pipeline import engine

    got = []
    monkeypatch.setattr(vllm, "LLM", lambda **kw: got.append(kw))
    monkeypatch.setattr(engine, "on_cpu", lambda: True)
    monkeypatch.setattr(engine, "clear_thread_env", lambda: None)
    v = validate_config({})["vllm"]
    engine.build_llm("m", v, seed=0, max_model_len=64)
    engine.build_llm("m", v | {"dtype": "bfloat16"}, seed=0, max_model_len=64)
    assert got[0].get("dtype") == (None if fast_bf16 else "float32") and got[1]["dtype"] == "bfloat16"
    monkeypatch.setattr(engine, "on_cpu", lambda: False)  # a GPU build: the checkpoint's dtype
    engine.build_llm("m", v, seed=0, max_model_len=64)
    assert "dtype" not in got[2]


def test_the_hf_target_loads_in_the_resolved_dtype(target_dir, fast_bf16):
    from eagle3_pipeline.hf_backend import load_hf_target

    assert next(load_hf_target(str(target_dir), "cpu").parameters()).dtype == (torch.bfloat16 if fast_bf16 else torch.float32)
    assert next(load_hf_target(str(target_dir), "cpu", dtype="bfloat16").parameters()).dtype == torch.bfloat16
