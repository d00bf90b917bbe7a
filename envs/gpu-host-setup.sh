#!/usr/bin/env bash
# An offline GPU host (docs/offline-gpu-host.md: "An offline GPU host"): builds .venv from the wheelhouse that
# `make wheelhouse` downloaded on a connected machine, on top of the host's torch.
#   bash envs/gpu-host-setup.sh [WHEELHOUSE]        (default: wheelhouse)
# The venv sees the host's packages: --system-site-packages covers a system Python; where the
# host's python3 is itself a virtual environment (e.g. torch in /opt/torch/.venv), a .pth file
# adds that environment's site-packages after .venv's own. Idempotent: a complete .venv (its
# marker matches envs/gpu-host*.txt, envs/cpu-nodeps.txt and this script) is reused; an
# interrupted or outdated one is rebuilt.
set -euo pipefail
WHEELHOUSE=${1:-wheelhouse}
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
MARKER=$VENV/.eagle3-gpu-host-complete
want=$(cat envs/gpu-host.txt envs/gpu-host-sdist.txt envs/cpu-nodeps.txt "$0" | sha256sum | cut -d' ' -f1)
if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$want" ]; then
  echo "reusing $VENV"
else
  ls "$WHEELHOUSE"/*.whl > /dev/null || { echo "no wheels in $WHEELHOUSE/: run 'make wheelhouse' on a connected machine and copy the folder here" >&2; exit 1; }
  rm -rf "$VENV"
  "$PYTHON" -m venv --system-site-packages "$VENV"
  site=$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')
  "$PYTHON" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/eagle3-host-python.pth"
  "$VENV/bin/pip" install -q --no-index --no-deps "$WHEELHOUSE"/*.whl
  echo "$want" > "$MARKER"
fi
"$VENV/bin/python" -c 'import torch, vllm, snakemake, speculators, transformers
print("torch", torch.__version__, "| vllm", vllm.__version__, "| snakemake", snakemake.__version__,
      "| transformers", transformers.__version__, "| GPUs", torch.cuda.device_count())'
