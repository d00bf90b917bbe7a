"""README's code runs as written: the vLLM serving snippet (spawn guard, chat template)."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def serving_snippet() -> str:
    """The README's one Python block that builds a vLLM ``LLM``."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    (snippet,) = [b for b in blocks if "LLM(" in b]
    return snippet


def test_serving_snippet_guards_the_engine_and_uses_the_chat_template():
    tree = ast.parse(serving_snippet())
    guards = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'"]
    assert len(guards) == 1, "vLLM spawns its engine: the LLM must be built under if __name__ == '__main__'"
    calls = {ast.unparse(n.func) for n in ast.walk(guards[0]) if isinstance(n, ast.Call)}
    assert {"LLM", "llm.chat"} <= calls and "llm.generate" not in calls
    outside = {ast.unparse(n.func) for stmt in tree.body if stmt is not guards[0] for n in ast.walk(stmt) if isinstance(n, ast.Call)}
    assert "LLM" not in outside


@pytest.mark.e2e
def test_serving_snippet_runs_with_the_end_to_end_drafter(e2e_run, tmp_path):
    wd, _, res = e2e_run
    script = tmp_path / "serve.py"
    # README's CPU advice: enforce_eager=True skips torch.compile (~4 minutes of this test on 2 cores)
    snippet = serving_snippet().replace("results/default/drafter", str(res / "drafter"))
    head, call, rest = snippet.partition("    llm = LLM(\n")
    snippet = head + call + rest.replace("\n    )\n", "\n        enforce_eager=True,\n    )\n", 1)  # the last argument
    assert "enforce_eager=True" in snippet
    script.write_text(snippet)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    r = subprocess.run([sys.executable, str(script)], cwd=wd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip(), "the chat answer is empty"
