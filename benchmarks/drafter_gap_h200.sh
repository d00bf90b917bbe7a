#!/usr/bin/env bash
# benchmarks/drafter_gap.py on one H200 within a fixed time: the reduced H200 example to its
# drafter, then the decomposition rows, most telling first, stopped at DEADLINE seconds from the
# start (a leased machine). Run from the checkout after envs/gpu-host-setup.sh:
#   DEADLINE=560 OUT=benchmarks/results bash benchmarks/drafter_gap_h200.sh
set -uo pipefail
DEADLINE=${DEADLINE:-1800}
OUT=${OUT:-benchmarks/results}
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
C="config/examples/smollm2-h200.yaml config/examples/smollm2-h200-gap.yaml"
mkdir -p "$OUT"
date -u +"pipeline %T"
timeout $((DEADLINE * 3 / 5)) .venv/bin/snakemake results/gap-h200/train/summary.json results/gap-h200/eval/prompts.jsonl \
  --cores 16 --configfile $C > "$OUT/drafter_gap_h200.snakemake.log" 2>&1 || { echo "the run did not reach its drafter"; exit 1; }
date -u +"gap %T ($SECONDS s)"
.venv/bin/python benchmarks/drafter_gap.py --configfile $C --prompts 60 --deadline $((DEADLINE - SECONDS - 15)) \
  --out "$OUT/drafter_gap_h200.json" --rows vllm/default offline/same-tokens/eval offline/validation-short vllm/runner-v1 \
  vllm/runner-v2 vllm/prefix-cache tensors vllm/k1 offline/validation vllm/batch-invariant offline/same-tokens vllm/eager vllm/one-at-a-time
date -u +"end %T ($SECONDS s)"
