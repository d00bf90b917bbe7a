#!/usr/bin/env bash
# Issue 19 on one H200 within DEADLINE seconds (a leased machine): the reduced H200 example
# (config/examples/smollm2-h200-gap.yaml) to its drafter; then, side by side, speculators' own
# trainer on the run's shards and vocab (benchmarks/reference_trainer.py --stage train) and
# benchmarks/drafter_gap.py's decomposition rows for the run's drafter, most telling first, at
# half the GPU's memory; last, the same vLLM and offline rows for speculators' drafter. Each
# script writes its JSON as rows finish. REFERENCE=0 leaves the reference trainer out.
# Each step is a phase (benchmarks/phases.py: a session of its own, its log in OUT, what it
# leaves running stopped when it ends), recorded with its status, time and log in
# OUT/drafter_gap_h200_phases.json; the script exits 1 at the end when a step failed, and 2
# before the first one when the checkout, its .venv, a package or the GPU is missing.
# Run after envs/gpu-host-setup.sh (from any folder; OUT relative to the current one):
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
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
[ -x .venv/bin/python ] || { echo "no .venv in $(pwd): run bash envs/gpu-host-setup.sh <wheelhouse> first" >&2; exit 2; }
C="config/examples/smollm2-h200.yaml config/examples/smollm2-h200-gap.yaml"
HALF="vllm: {gpu_memory_utilization: 0.45}"
P=(.venv/bin/python benchmarks/phases.py)
REC="$OUT/drafter_gap_h200_phases.json"
"${P[@]}" check --cuda --packages vllm speculators snakemake datasets --paths $C || exit 2
"${P[@]}" start --json "$REC" --command "DEADLINE=$DEADLINE OUT=$OUT PROMPTS=$PROMPTS REFERENCE=$REFERENCE ROWS='$ROWS' bash $0"
date -u +"pipeline %T"
"${P[@]}" run --json "$REC" --name pipeline --log "$OUT/drafter_gap_h200.snakemake.log" --timeout $((DEADLINE / 2)) -- \
  .venv/bin/snakemake results/gap-h200/train/summary.json results/gap-h200/eval/prompts.jsonl --cores 16 --configfile $C \
  || { echo "the run did not reach its drafter"; "${P[@]}" finish --json "$REC"; exit 1; }
date -u +"reference trainer and gap rows %T ($SECONDS s)"
if [ "$REFERENCE" = 1 ]; then
  "${P[@]}" run --json "$REC" --name reference_train --log "$OUT/reference_trainer_h200.log" --timeout $((DEADLINE - SECONDS - KEEP)) -- \
    .venv/bin/python benchmarks/reference_trainer.py --configfile $C --stage train --out "$OUT/reference_trainer_h200.json" &
  REF=$!
  sleep 60  # the trainer takes its memory before the first engine profiles the GPU's
fi
ROWS_DEADLINE=$((DEADLINE - SECONDS - KEEP))
# drafter_gap.py stops its rows at --deadline itself; the phase's timeout leaves it a minute to write its JSON
"${P[@]}" run --json "$REC" --name gap_rows --log "$OUT/drafter_gap_h200.log" --timeout $((ROWS_DEADLINE + 60)) -- \
  .venv/bin/python benchmarks/drafter_gap.py --configfile $C --config "$HALF" --prompts "$PROMPTS" \
  --deadline "$ROWS_DEADLINE" --out "$OUT/drafter_gap_h200.json" --rows $ROWS
date -u +"gap rows done %T ($SECONDS s)"
if [ "$REFERENCE" = 1 ]; then
  wait "$REF"
  date -u +"reference rows %T ($SECONDS s)"
  "${P[@]}" run --json "$REC" --name reference_rows --log "$OUT/reference_trainer_h200.rows.log" --timeout $((DEADLINE - SECONDS)) -- \
    .venv/bin/python benchmarks/reference_trainer.py --configfile $C --stage rows --prompts "$PROMPTS" \
    --ours-rows "$OUT/drafter_gap_h200.json" --deadline $((DEADLINE - SECONDS - 10)) --out "$OUT/reference_trainer_h200.json"
fi
date -u +"end %T ($SECONDS s)"
"${P[@]}" finish --json "$REC"
