#!/usr/bin/env bash
# Issue 19 on one H200 within DEADLINE seconds (a leased machine): the reduced H200 example
# (config/examples/smollm2-h200-gap.yaml) to its drafter; then, side by side, speculators' own
# trainer on the run's shards and vocab (benchmarks/reference_trainer.py --stage train) and
# benchmarks/drafter_gap.py's decomposition rows for the run's drafter, most telling first, at
# half the GPU's memory; last, the same vLLM and offline rows for speculators' drafter. Each
# script writes its JSON as rows finish. REFERENCE=0 leaves the reference trainer out. Run from
# the checkout after envs/gpu-host-setup.sh:
#   DEADLINE=1200 OUT=benchmarks/results bash benchmarks/drafter_gap_h200.sh
set -uo pipefail
DEADLINE=${DEADLINE:-1800}
OUT=${OUT:-benchmarks/results}
PROMPTS=${PROMPTS:-100}
REFERENCE=${REFERENCE:-1}
ROWS=${ROWS:-vllm/default offline/same-tokens/eval offline/validation-short tensors vllm/runner-v1 vllm/runner-v2 \
vllm/prefix-cache vllm/k1 offline/validation vllm/eager vllm/batch-invariant offline/same-tokens vllm/one-at-a-time}
KEEP=$((REFERENCE == 1 ? 200 : 15))  # seconds the rows leave for the reference drafter's rows
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
C="config/examples/smollm2-h200.yaml config/examples/smollm2-h200-gap.yaml"
HALF="vllm: {gpu_memory_utilization: 0.45}"
mkdir -p "$OUT"
date -u +"pipeline %T"
timeout $((DEADLINE / 2)) .venv/bin/snakemake results/gap-h200/train/summary.json results/gap-h200/eval/prompts.jsonl \
  --cores 16 --configfile $C > "$OUT/drafter_gap_h200.snakemake.log" 2>&1 || { echo "the run did not reach its drafter"; exit 1; }
date -u +"reference trainer and gap rows %T ($SECONDS s)"
[ "$REFERENCE" = 1 ] && .venv/bin/python benchmarks/reference_trainer.py --configfile $C --stage train --out "$OUT/reference_trainer_h200.json" \
  > "$OUT/reference_trainer_h200.log" 2>&1 &
REF=$!
[ "$REFERENCE" = 1 ] && sleep 60  # the trainer takes its memory before the first engine profiles the GPU's
.venv/bin/python benchmarks/drafter_gap.py --configfile $C --config "$HALF" --prompts "$PROMPTS" \
  --deadline $((DEADLINE - SECONDS - KEEP)) --out "$OUT/drafter_gap_h200.json" --rows $ROWS
date -u +"gap rows done %T ($SECONDS s)"
[ "$REFERENCE" = 1 ] || { date -u +"end %T ($SECONDS s)"; exit 0; }
wait $REF
date -u +"reference rows %T ($SECONDS s)"
.venv/bin/python benchmarks/reference_trainer.py --configfile $C --stage rows --prompts "$PROMPTS" \
  --ours-rows "$OUT/drafter_gap_h200.json" --deadline $((DEADLINE - SECONDS - 10)) --out "$OUT/reference_trainer_h200.json" \
  >> "$OUT/reference_trainer_h200.log" 2>&1
date -u +"end %T ($SECONDS s)"
