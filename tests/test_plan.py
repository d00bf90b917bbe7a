"""Run planning: work, time and disk per stage, from reference figures or this run's measurements."""

import json
from pathlib import Path

import pytest
from e2e_support import snakemake_cli
from transformers import LlamaConfig

from eagle3_pipeline.config import validate_config
from eagle3_pipeline.plan import (
    BUILTIN_SHAPE,
    COMPLETION_FILL,
    PROMPT_TOKENS,
    REFERENCE,
    estimate_params,
    estimate_vs_actual,
    make_plan,
    plan_run,
)

ROOT = Path(__file__).resolve().parents[1]


def _by_stage(plan):
    return {p.stage: p for p in plan}


def test_fresh_run_is_planned_from_the_reference_figures(tmp_path):
    cfg = validate_config({"prompts": {"max_prompts": 300}, "generation": {"max_tokens": 256}})
    plan = _by_stage(make_plan(cfg, BUILTIN_SHAPE, tmp_path, "cpu"))
    ref = REFERENCE["cpu"]
    scale = ref["params"] / BUILTIN_SHAPE["params"]
    gen = plan["generate_traces"]
    assert gen.tokens == int(300 * COMPLETION_FILL * 256)
    assert gen.seconds == pytest.approx(
        ref["generate_traces"]["load_seconds"] + gen.tokens / (ref["generate_traces"]["tokens_per_second"] * scale), abs=0.1
    )
    assert gen.source.startswith("reference (this project's demo run on 2 CPU cores")
    ext = plan["extract_hidden_states"]
    assert ext.tokens == int(300 * (PROMPT_TOKENS + COMPLETION_FILL * 256))
    # tokens x 4 captured layers ([2, 15, 27] + 30) x hidden 576 x 2 bytes (bf16)
    assert ext.disk_bytes == ext.tokens * 4 * 576 * 2
    assert plan["train_drafter"].tokens == int(ext.tokens * cfg["training"]["epochs"] * (1 - cfg["training"]["val_fraction"]))
    assert plan["evaluate_drafter"].tokens == 80 * cfg["evaluation"]["max_tokens"]
    assert not any(p.done for p in plan.values())


def test_fp8_storage_halves_the_planned_disk_plus_scales(tmp_path):
    cfg = validate_config({"prompts": {"max_prompts": 10}, "extraction": {"storage_dtype": "float8_e4m3fn"}})
    ext = _by_stage(make_plan(cfg, BUILTIN_SHAPE, tmp_path, "cpu"))["extract_hidden_states"]
    assert ext.disk_bytes == ext.tokens * (4 * 576 * 1 + 4 * 4)


def test_measured_throughput_and_token_counts_of_this_run_win(tmp_path):
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces/shard-00000.summary.json").write_text(
        json.dumps({"ok": 100, "prompt_tokens": 20_000, "completion_tokens": 30_000, "generate_seconds": 60.0, "model_load_seconds": 12.0})
    )
    cfg = validate_config({"prompts": {"max_prompts": 100}})
    stages, platform = plan_run(cfg, None, tmp_path, platform="cpu")
    plan = _by_stage(stages)
    gen = plan["generate_traces"]
    assert gen.done and gen.tokens_per_second == 500.0 and gen.load_seconds == 12.0
    assert gen.source.startswith("measured: 1 file(s)") and "traces/shard-00000.summary.json" in gen.source
    ext = plan["extract_hidden_states"]
    assert not ext.done and ext.tokens == 100 * (200 + 300)  # per-sample means from the traces
    assert ext.source.startswith("reference")


def test_parameter_count_of_a_llama_3_1_8b_config():
    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    )
    assert estimate_params(cfg) == 8_030_261_248  # what the instantiated model counted on the H200


def test_estimate_vs_actual_covers_the_stages_that_were_pending(tmp_path):
    (tmp_path / "hidden_states").mkdir()
    (tmp_path / "hidden_states/shard-00000.index.json").write_text(json.dumps({"model_load_seconds": 3.0, "extract_seconds": 57.0}))
    (tmp_path / "train").mkdir()
    (tmp_path / "train/summary.json").write_text(json.dumps({"seconds": 5.0}))
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "train_drafter.tsv").write_text("s\th:m:s\tmax_rss\n12.5\t0:00:12\t100\n")
    plan = {
        "platform": "cpu",
        "stages": [
            {"stage": "generate_traces", "seconds": 100.0, "done": True, "source": "x"},
            {"stage": "extract_hidden_states", "seconds": 40.0, "done": False, "source": "reference"},
            {"stage": "train_drafter", "seconds": 10.0, "done": False, "source": "reference"},
            {"stage": "evaluate_drafter", "seconds": "x", "done": False},  # malformed: skipped
        ],
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    rows = estimate_vs_actual(tmp_path / "plan.json", tmp_path, bench)
    assert rows == [
        # no benchmark file: load + work seconds from the index
        {
            "stage": "extract_hidden_states",
            "estimated_seconds": 40.0,
            "actual_seconds": 60.0,
            "actual_over_estimate": 1.5,
            "source": "reference",
        },
        # the job's wall time from its benchmark file, not the summary's 5 s
        {"stage": "train_drafter", "estimated_seconds": 10.0, "actual_seconds": 12.5, "actual_over_estimate": 1.25, "source": "reference"},
    ]
    assert estimate_vs_actual(tmp_path / "missing.json", tmp_path) == []
    for bad in ('{"platform": "cpu"}', '{"stages": null}', '"x"', "[]", '{"stages": [{}]}'):
        (tmp_path / "plan.json").write_text(bad)
        assert estimate_vs_actual(tmp_path / "plan.json", tmp_path) == []


def test_malformed_measurements_are_left_out_not_fatal(tmp_path):
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces/shard-00000.summary.json").write_text(json.dumps({"generate_seconds": 0, "ok": None}))
    (tmp_path / "train").mkdir()
    (tmp_path / "train/summary.json").write_text('"x"')
    cfg = validate_config({"prompts": {"max_prompts": 10}})
    plan = _by_stage(make_plan(cfg, BUILTIN_SHAPE, tmp_path, "cpu"))
    assert plan["generate_traces"].source.startswith("reference") and plan["train_drafter"].source.startswith("reference")


def test_snakemake_plan_writes_the_plan_without_running_anything(tmp_path):
    wd = tmp_path / "wd"
    r = snakemake_cli(
        wd,
        ROOT / "config/config.yaml",
        "--cores",
        "1",
        targets=("plan",),
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr + r.stdout
    plan = json.loads((wd / "results/default/plan.json").read_text())
    assert [s["stage"] for s in plan["stages"]] == ["generate_traces", "extract_hidden_states", "train_drafter", "evaluate_drafter"]
    assert plan["total_seconds"] == pytest.approx(sum(s["seconds"] for s in plan["stages"]))
    log = (wd / "logs/default/plan.log").read_text()
    assert "extract_hidden_states" in log and "total (pending stages)" in log
    assert not (wd / "results/default/traces").exists()
    assert "total (pending stages)" in r.stderr  # printed on the terminal too
