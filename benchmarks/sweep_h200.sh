#!/usr/bin/env bash
# Issue 19 part 3 on one H200 within DEADLINE seconds (a leased machine): the reduced H200
# example (config/examples/smollm2-h200-gap.yaml) with the drafter variants of
# config/examples/smollm2-h200-gap-sweep.yaml named in VARIANTS (all when empty). The run's
# traces and hidden states first; then the run's drafter and the variants' train side by side,
# PARALLEL at a time on the one GPU (a 135M target's drafter leaves most of an H200 idle), with
# the host lock off for this one invocation; then Snakemake's own order evaluates every drafter,
# one engine at a time, and writes results/gap-h200/sweep.json (and OUT/sweep_h200_rows.tgz, each
# drafter's acceptance and training record, should the table not be reached). Last, with what time is left,
# benchmarks/drafter_gap.py's ROWS for the run's drafter.
# Each step is a phase (benchmarks/phases.py: a session of its own, its log in OUT, what it
# leaves running stopped when it ends), recorded with its status, time and log in
# OUT/sweep_h200_phases.json; the script exits 1 at the end when a step failed, and 2 before
# the first one when the checkout, its .venv, a package, the GPU or a variant is missing.
# Run after envs/gpu-host-setup.sh (from any folder; OUT relative to the current one):
#   DEADLINE=1200 VARIANTS="sched_linear loops_drop" OUT=benchmarks/results bash benchmarks/sweep_h200.sh
set -uo pipefail
DEADLINE=${DEADLINE:-1800}
OUT=${OUT:-benchmarks/results}
PARALLEL=${PARALLEL:-4}
VARIANTS=${VARIANTS:-}
ROWS=${ROWS:-vllm/batch-invariant vllm/one-at-a-time tensors}
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
[ -x .venv/bin/python ] || { echo "no .venv in $(pwd): run bash envs/gpu-host-setup.sh <wheelhouse> first" >&2; exit 2; }
SM=${SM:-.venv/bin/snakemake}
P=(.venv/bin/python benchmarks/phases.py)
REC="$OUT/sweep_h200_phases.json"
"${P[@]}" check --cuda --packages vllm speculators snakemake \
  --paths config/examples/smollm2-h200.yaml config/examples/smollm2-h200-gap.yaml config/examples/smollm2-h200-gap-sweep.yaml || exit 2
mkdir -p results
SUB=results/.sweep-h200-variants.yaml
NOLOCK=results/.sweep-h200-nolock.yaml
VARIANTS="$VARIANTS" .venv/bin/python - "$SUB" <<'PY' || exit 2
import os, sys, yaml
cfg = yaml.safe_load(open("config/examples/smollm2-h200-gap-sweep.yaml"))
names = os.environ["VARIANTS"].split() or list(cfg["sweep"]["variants"])
unknown = sorted(set(names) - set(cfg["sweep"]["variants"]))
if unknown:
    sys.exit(f"VARIANTS names {unknown}, not variants of smollm2-h200-gap-sweep.yaml")
cfg["sweep"]["variants"] = {n: cfg["sweep"]["variants"][n] for n in names}
yaml.safe_dump(cfg, open(sys.argv[1], "w"), sort_keys=False)
PY
echo "resources: {host_lock: false}" > "$NOLOCK"
C="config/examples/smollm2-h200.yaml config/examples/smollm2-h200-gap.yaml $SUB"
TRAINED=$(.venv/bin/python -c "
import sys, yaml
print(' '.join(['results/gap-h200/train/summary.json'] + [f'results/gap-h200/sweep/{n}/train/summary.json' for n in yaml.safe_load(open(sys.argv[1]))['sweep']['variants']]))" "$SUB")
"${P[@]}" start --json "$REC" --command "DEADLINE=$DEADLINE OUT=$OUT PARALLEL=$PARALLEL VARIANTS='$VARIANTS' ROWS='$ROWS' bash $0"
date -u +"traces, states and $PARALLEL trainings at a time %T"
"${P[@]}" run --json "$REC" --name train --log "$OUT/sweep_h200.train.log" --timeout $((DEADLINE - 360)) -- \
  $SM --cores 64 --resources gpu="$PARALLEL" full_model=8 --keep-going --configfile $C "$NOLOCK" -- $TRAINED results/gap-h200/eval/prompts.jsonl
date -u +"evaluations %T ($SECONDS s)"
"${P[@]}" run --json "$REC" --name evaluate --log "$OUT/sweep_h200.eval.log" --timeout $((DEADLINE - SECONDS - 60)) -- \
  $SM --cores 16 --keep-going --configfile $C -- results/gap-h200/sweep.json
cp results/gap-h200/sweep.json results/gap-h200/sweep.md "$OUT/" 2>/dev/null
(cd results/gap-h200 && tar czf "$OUT/sweep_h200_rows.tgz" --ignore-failed-read $(ls -d {,sweep/*/}{eval/acceptance.json,train/summary.json,train/metrics.jsonl} 2>/dev/null))
for d in results/gap-h200/train results/gap-h200/sweep/*/train; do  # training cost side by side
  [ -f "$d/summary.json" ] && .venv/bin/python -c "import json, sys; s = json.load(open(sys.argv[1])); \
print(sys.argv[1], s['total_seconds'], s['steps'], s['peak_gpu_allocated_bytes'])" "$d/summary.json"
done
date -u +"gap rows %T ($SECONDS s)"
if [ $((DEADLINE - SECONDS)) -gt 120 ]; then
  ROWS_DEADLINE=$((DEADLINE - SECONDS - 15))
  "${P[@]}" run --json "$REC" --name gap_rows --log "$OUT/drafter_gap_h200_more.log" --timeout $((ROWS_DEADLINE + 10)) -- \
    .venv/bin/python benchmarks/drafter_gap.py --configfile config/examples/smollm2-h200.yaml config/examples/smollm2-h200-gap.yaml \
    --prompts 100 --deadline "$ROWS_DEADLINE" --out "$OUT/drafter_gap_h200_more.json" --rows $ROWS
fi
date -u +"end %T ($SECONDS s)"
"${P[@]}" finish --json "$REC"
