#!/usr/bin/env bash
# Train, calibrate and evaluate DSpark and DFlash drafters for a local Qwen2.5-Coder target on this CPU,
# beside draft_model and ngram (issue 6). Every stage resumes where it stopped: rerun after an interruption.
# Weights and data go to $WORK, outside git.
#
#   recipes/local-drafters.sh                 # everything (several CPU hours on 2 cores)
#   STAGES="data cache" recipes/local-drafters.sh
#   STEPS=4800 SUFFIX=-long SMALL_BUDGET=0 BASELINES=0 \
#     STAGES="train calibrate eval bench" recipes/local-drafters.sh
#                                             # a 4x budget beside the first (drafters dspark-long, dflash-long)
#
# Stages: data (the target answers code prompts), cache (target features), train (dspark, dflash and, with
# SMALL_BUDGET, a dspark on a quarter of the data to show how tau grows with data; then every run's
# training curves in training-curves.png), calibrate (STS),
# eval (tau per dataset, per position, calibration), bench (batch-1 tokens/s and ideal speedup).
set -euo pipefail
cd "$(dirname "$0")/.."

SPECSERVE=${SPECSERVE:-.venv/bin/specserve}
TARGET=${TARGET:-qwen2.5-coder-1.5b}
DRAFT_MODEL=${DRAFT_MODEL:-qwen2.5-coder-0.5b}
WORK=${WORK:-$HOME/.cache/specserve/drafters/$TARGET}
EVAL=${EVAL:-benchmarks/data}
PROMPTS=${PROMPTS:-480}            # code prompts the target answers; the last HELD_OUT calibrate
HELD_OUT=${HELD_OUT:-32}
MAX_TOKENS=${MAX_TOKENS:-256}
IN_FLIGHT=${IN_FLIGHT:-32}         # requests generated together
# Optimizer steps of BATCH sequences (the quarter-data drafter: STEPS / 4). A DSpark step of 4 x 32 blocks
# of 7 takes ~1.5 s here (1.5B target, 1 layer with a 2048-wide MLP, rank 64, the ~6k-token training
# vocabulary), so 1200 steps (~11 epochs of 448 answers) take ~31 min; DFlash ~25 min.
STEPS=${STEPS:-1200}
LR=${LR:-2e-3}                     # above DeepSpec's 6e-4: a thousand steps, not tens of thousands
BATCH=${BATCH:-4}
ANCHORS=${ANCHORS:-32}             # blocks per sequence and step
LAYERS=${LAYERS:-1}
BLOCK=${BLOCK:-7}
MARKOV_RANK=${MARKOV_RANK:-64}     # W2 [V, r] is read once per drafted token: r = 256 costs ~7 ms a slot here
INTERMEDIATE=${INTERMEDIATE-2048}  # the draft MLP's width (set empty: the target's 8960, 1.25x a step)
SUFFIX=${SUFFIX:-}                 # drafter directories are dspark$SUFFIX and dflash$SUFFIX
SMALL_BUDGET=${SMALL_BUDGET:-1}
BASELINES=${BASELINES:-1}          # eval and bench draft_model and ngram too (0: a second budget's run)
EVAL_PROMPTS=${EVAL_PROMPTS:-10}   # per dataset
EVAL_TOKENS=${EVAL_TOKENS:-128}
STAGES=${STAGES:-data cache train calibrate eval bench}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}  # spinning OpenMP threads slow everything else here

mkdir -p "$WORK"
has_stage() { [[ " $STAGES " == *" $1 "* ]]; }
DSPARK=dspark$SUFFIX
DFLASH=dflash$SUFFIX
drafter() { echo "{\"method\": \"$1\", \"model\": \"$WORK/$2\"${3:+, $3}}"; }

if has_stage data; then
  "$SPECSERVE" data regenerate --model "$TARGET" --code-prompts "$PROMPTS" --output "$WORK/answers.jsonl" \
    --max-tokens "$MAX_TOKENS" --batch-size "$IN_FLIGHT"
  # Rows are written in completion order with their prompt id: split by id.
  python3 - "$WORK" "$HELD_OUT" "$PROMPTS" <<'EOF'
import json, sys
work, held_out, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows = [json.loads(line) for line in open(f"{work}/answers.jsonl") if line.strip()]
train = [r for r in rows if r["id"] < total - held_out]
with open(f"{work}/train.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in train)
with open(f"{work}/held-out.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows if r["id"] >= total - held_out)
EOF
fi

if has_stage cache && [[ ! -f "$WORK/cache-train/manifest.json" ]]; then
  "$SPECSERVE" data target-cache --model "$TARGET" --data "$WORK/train.jsonl" --output "$WORK/cache-train"
fi

# Training only: glibc hands every freed tensor over 32 MiB back to the kernel and faults the next one in
# again (a third of a full-vocabulary step went to the kernel); keep freed memory in the process instead.
# Not for inference: the weights then sit in small pages and decode ran ~25% slower with it.
train() {  # name method steps [more arguments]
  MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 "$SPECSERVE" train --model "$TARGET" --cache "$WORK/cache-train" --output "$WORK/$1" --method "$2" \
    --layers "$LAYERS" --block-size "$BLOCK" --steps "$3" \
    --batch-size "$BATCH" --num-anchors "$ANCHORS" --lr "$LR" ${INTERMEDIATE:+--intermediate-size "$INTERMEDIATE"} \
    --checkpoint-every 50 "${@:4}"
}
if has_stage train; then
  train "$DSPARK" dspark "$STEPS" --markov-rank "$MARKOV_RANK"  # DFlash has no Markov head
  train "$DFLASH" dflash "$STEPS"
  if [[ $SMALL_BUDGET == 1 ]]; then
    samples=$(python3 -c "import json; print(json.load(open('$WORK/cache-train/manifest.json'))['num_samples'])")
    train "$DSPARK-quarter" dspark $((STEPS / 4)) --markov-rank "$MARKOV_RANK" --num-samples $((samples / 4))
  fi
  # Every run under $WORK side by side: how tau grows with steps and data.
  runs=()
  for log in "$WORK"/*/metrics.jsonl; do runs+=(--run "$(basename "$(dirname "$log")")=$(dirname "$log")"); done
  "$SPECSERVE" train-curves "${runs[@]}" --output "$WORK/training-curves.png"
fi

if has_stage calibrate; then
  "$SPECSERVE" calibrate --model "$TARGET" --speculative-config "$(drafter dspark "$DSPARK")" \
    --prompts "$WORK/held-out.jsonl" --num-prompts "$HELD_OUT" --max-tokens "$EVAL_TOKENS"
fi

DATASETS="$EVAL/humaneval.jsonl,$EVAL/mbpp.jsonl,$EVAL/gsm8k.jsonl,$EVAL/mt-bench.jsonl"
if has_stage eval; then
  extra=()
  [[ $SMALL_BUDGET == 1 ]] && extra+=(--drafter "$DSPARK-quarter=$(drafter dspark "$DSPARK-quarter")")
  [[ $BASELINES == 1 ]] && extra+=(
    --drafter "draft_model={\"method\": \"draft_model\", \"model\": \"$DRAFT_MODEL\", \"num_speculative_tokens\": 5}"
    --drafter 'ngram={"method": "ngram", "num_speculative_tokens": 5}')
  "$SPECSERVE" eval --model "$TARGET" --datasets "$DATASETS" --num-prompts "$EVAL_PROMPTS" \
    --max-tokens "$EVAL_TOKENS" --output "$WORK/eval$SUFFIX" \
    --drafter "$DSPARK=$(drafter dspark "$DSPARK")" --drafter "$DFLASH=$(drafter dflash "$DFLASH")" "${extra[@]}"
fi

if has_stage bench; then
  extra=()
  [[ $BASELINES == 1 ]] && extra+=(
    --drafter "draft_model k5={\"method\": \"draft_model\", \"model\": \"$DRAFT_MODEL\", \"num_speculative_tokens\": 5}"
    --drafter 'ngram k5={"method": "ngram", "num_speculative_tokens": 5}')
  "$SPECSERVE" bench spec --model "$TARGET" --prompts "$EVAL/humaneval.jsonl" --num-prompts "$EVAL_PROMPTS" \
    --new-tokens "$EVAL_TOKENS" --no-transformers \
    --drafter "$DSPARK=$(drafter dspark "$DSPARK")" \
    --drafter "$DSPARK scheduled=$(drafter dspark "$DSPARK" '"verify_policy": "dspark"')" \
    --drafter "$DFLASH=$(drafter dflash "$DFLASH")" "${extra[@]}" | tee "$WORK/bench-humaneval$SUFFIX.txt"
fi
