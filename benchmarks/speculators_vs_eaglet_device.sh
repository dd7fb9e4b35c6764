#!/usr/bin/env bash
# eaglet's trainer against speculators 0.9.0's own trainer on the same hidden states of the same target, both drafts
# served by vLLM on the same held-out prompts (issue 59, item 2). On one GPU, one part per device call:
#   bash scripts/device.sh bash benchmarks/speculators_vs_eaglet_device.sh data      # prompts -> answers -> stores
#   bash scripts/device.sh bash benchmarks/speculators_vs_eaglet_device.sh convert   # the stores as speculators reads them
#   bash scripts/device.sh bash benchmarks/speculators_vs_eaglet_device.sh train     # eaglet, its recommended settings
#   bash scripts/device.sh bash benchmarks/speculators_vs_eaglet_device.sh speculators  # speculators, its own
#   bash scripts/device.sh bash benchmarks/speculators_vs_eaglet_device.sh eaglet-matched  # eaglet with speculators' settings
#   bash scripts/device.sh bash benchmarks/speculators_vs_eaglet_device.sh matched   # speculators with eaglet's settings
#   bash scripts/device.sh bash benchmarks/speculators_vs_eaglet_device.sh vllm      # vLLM serves each draft (staged first)
#   bash scripts/device.sh bash benchmarks/speculators_vs_eaglet_device.sh eval      # eaglet's own decoder on each
# Both trainers see the same samples for EPOCHS (default 8) epochs: eaglet's recipe (16,384 tokens a step, lr 5e-4,
# cosine, 7 TTT steps, EAGLE 3.1) and speculators' defaults (8,192 tokens a step, lr 1e-3, linear, 3 TTT steps, one
# norm over the fused features); `eaglet-matched` trains eaglet with speculators' settings (EAGLE 3.1's per-feature
# norms: eaglet has no single norm over the concatenation), `matched` speculators with eaglet's, as far as its flags go.
# speculators holds out the held-out store's rows as its validation split (speculators_same_data.py --heldout).
# speculators' wheels travel in .device/specwhl (../shared/anchors/speculators-0.9.0/README.md lists them, plus xxhash
# and aiohttp's closure for `datasets`). Results (JSON, logs) under $OUT.
set -uo pipefail
WORK=${WORK:-/tmp/specvs}
OUT=${OUT:-$WORK/out}
EPOCHS=${EPOCHS:-8}
DEPTH=${DEPTH:-3}
MAX_PROMPTS=${MAX_PROMPTS:-16}
SPEC_SITE=/tmp/site-spec
mkdir -p "$WORK" "$OUT"
base_path=${PYTHONPATH:-}
export VLLM_USE_FLASHINFER_SAMPLER=0
eaglet() { PYTHONPATH=/tmp/vllm-site:$base_path python3 -m eaglet.cli "$@"; }
store=$WORK/data/store
heldout=$WORK/data/store_heldout
data=$WORK/speculators-data
prompts=(--prompts demo --prompts mt-bench --prompts "$WORK/data/synthesized.jsonl")
drafts=(eaglet-own speculators-own eaglet-matched speculators-matched)

served_dir() {  # the directory each draft is served from: eaglet's vLLM export; speculators' last epoch as it saved it
  case "$1" in
    eaglet-*) echo "$WORK/$1-vllm" ;;
    *) echo "$WORK/$1/$((EPOCHS - 1))" ;;
  esac
}

speculators_train() {  # NAME, then speculators' flags beyond the shared ones
  local name=$1; shift
  local verifier vocab layers ratio
  verifier=$(eaglet target info --json | python3 -c "import json, sys; print(json.load(sys.stdin)['path'])")
  vocab=$(python3 -c "import json; print(json.load(open('$WORK/convert.json'))['draft_vocab_size'])")
  layers=$(python3 -c "import json; print(*json.load(open('$WORK/convert.json'))['aux_layer_ids'])")
  ratio=$(python3 -c "import json; print(json.load(open('$WORK/convert.json'))['train_data_ratio'])")
  /usr/bin/time -f "train $name: %e s" env PYTHONPATH="$SPEC_SITE:$base_path" python3 benchmarks/speculators_train.py --speculator-type eagle3 --verifier-name-or-path "$verifier" \
    --data-path "$data" --d2t-path "$data/d2t-$vocab.npy" --t2d-path "$data/t2d-$vocab.npy" \
    --target-layer-ids $layers --train-data-ratio "$ratio" --epochs "$EPOCHS" --seed 0 \
    --save-path "$WORK/$name" --log-dir "$WORK/$name-logs" --num-workers 4 "$@" > "$OUT/train-$name.log" 2>&1
  tr '\r' '\n' < "$OUT/train-$name.log" | grep -E "it/s\]$|train $name|Error|error" | grep -E "100%|train $name|rror" | tail -4
  cp "$WORK/$name/$((EPOCHS - 1))/config.json" "$OUT/config-$name.json" 2>/dev/null
}

case "${1:-}" in
  data)
    for stage in synthesize regenerate prepare extract; do
      /usr/bin/time -f "$stage: %e s" python3 -m eaglet.cli run benchmarks/configs/speculators_same_data.yaml \
        --out "$WORK/data" --only "$stage" 2>&1 | grep -v "it/s\]$" | tail -3
    done
    ;;
  convert)
    if [ ! -f "$SPEC_SITE/.installed" ]; then
      python3 -m pip install -q --no-index --no-deps --target "$SPEC_SITE" .device/specwhl/*.whl && touch "$SPEC_SITE/.installed"
    fi
    [ -f "$WORK/convert.json" ] || /usr/bin/time -f "convert: %e s" env PYTHONPATH="$SPEC_SITE:$base_path" \
      python3 benchmarks/speculators_same_data.py convert "$store" "$data" --heldout "$heldout" > "$WORK/convert.json"
    cp "$WORK/convert.json" "$OUT/"; cat "$OUT/convert.json"
    env PYTHONPATH="$SPEC_SITE:$base_path" python3 benchmarks/speculators_same_data.py check "$store" "$data" --max-rows 200 | tee "$OUT/check.json"
    ;;
  train)  # eaglet's recipe (`speculators` then trains speculators' run alone on the GPU)
    /usr/bin/time -f "train eaglet-own: %e s" python3 -m eaglet.cli train --store "$store" --eval-store "$heldout" \
      --out "$WORK/eaglet-own" --token-budget 16384 --lr 0.0005 --epochs "$EPOCHS" --attention-kernels one \
      --eval-every 200 --log-every 50 --seed 0 > "$OUT/train-eaglet-own.log" 2>&1
    grep -v "it/s\]$" "$OUT/train-eaglet-own.log" | tail -3
    cp "$WORK/eaglet-own/metrics.jsonl" "$OUT/metrics-eaglet-own.jsonl" 2>/dev/null
    [ -d "$(served_dir eaglet-own)" ] || eaglet export --draft "$WORK/eaglet-own" --format vllm \
      --out "$(served_dir eaglet-own)" 2>&1 | tail -1
    ;;
  speculators)  # speculators' defaults
    speculators_train speculators-own
    ;;
  eaglet-matched)  # eaglet's trainer with speculators' defaults: tokens a step, lr, linear schedule, AdamW, 3 TTT steps
    /usr/bin/time -f "train eaglet-matched: %e s" python3 -m eaglet.cli train --store "$store" --eval-store "$heldout" \
      --out "$WORK/eaglet-matched" --token-budget 8192 --lr 0.001 --schedule linear --warmup-steps 15 \
      --min-lr-ratio 0 --weight-decay 0.01 --betas 0.9,0.999 --ttt-steps 3 --loss-decay 1.0 --epochs "$EPOCHS" \
      --attention-kernels one --eval-every 400 --log-every 100 --seed 0 > "$OUT/train-eaglet-matched.log" 2>&1
    grep -v "it/s\]$" "$OUT/train-eaglet-matched.log" | tail -3
    cp "$WORK/eaglet-matched/metrics.jsonl" "$OUT/metrics-eaglet-matched.jsonl" 2>/dev/null
    [ -d "$(served_dir eaglet-matched)" ] || eaglet export --draft "$WORK/eaglet-matched" --format vllm \
      --out "$(served_dir eaglet-matched)" 2>&1 | tail -1
    ;;
  matched)  # speculators' trainer with eaglet's recipe: tokens a step, lr and schedule, TTT steps and decay, 3.1 norms
    speculators_train speculators-matched --total-seq-len 16384 --lr 0.0005 --scheduler-type cosine \
      --ttt-steps 7 --ttt-step-loss-decay 0.8 --weight-decay 0 --fc-norm --no-norm-before-fc --norm-output
    ;;
  vllm)
    for name in "${drafts[@]}"; do
      [ -d "$(served_dir "$name")" ] || continue
      eaglet eval --backend vllm --draft "$(served_dir "$name")" "${prompts[@]}" --max-prompts "$MAX_PROMPTS" \
        --max-new-tokens 128 --depth "$DEPTH" --out "$WORK/vllm-$name" 2>&1 | grep -v "it/s\]$" | tail -3
      cp "$WORK/vllm-$name/report.json" "$OUT/vllm-$name.json"
    done
    ;;
  eval)
    for name in "${drafts[@]}"; do
      [ -d "$(served_dir "$name")" ] || continue
      eaglet eval --draft "$(served_dir "$name")" "${prompts[@]}" --max-prompts "$MAX_PROMPTS" \
        --max-new-tokens 128 --mode chain --depth "$DEPTH" --dtype bfloat16 --out "$WORK/eval-$name" 2>&1 | tail -2
      cp "$WORK/eval-$name/report.json" "$OUT/eval-$name.json"
    done
    ;;
  *) echo "usage: $0 data|convert|train|speculators|eaglet-matched|matched|vllm|eval" >&2; exit 2 ;;
esac
