#!/usr/bin/env bash
# A restructure measured on the H200: the same three benchmarks on two source trees, interleaved, REPEATS times each,
# in one call (through scripts/device.sh). BEFORE is a directory holding another commit's src/ and benchmarks/
# (`git archive COMMIT src benchmarks | tar -x -C DIR`); the working tree is "after".
#   BEFORE=.before bash scripts/device.sh bash benchmarks/before_after_h200.sh train   # 8B-shaped TTT step
#   BEFORE=.before bash scripts/device.sh bash benchmarks/before_after_h200.sh decode  # chain and tree rounds + extraction
# Each run writes $OUT/<tree>_<bench>_<n>.json; benchmarks/before_after_summary.py prints medians and spreads.
set -uo pipefail
BEFORE=${BEFORE:?a directory with the earlier src/ and benchmarks/}
REPEATS=${REPEATS:-3}
OUT=${OUT:-/tmp/before_after}
mkdir -p "$OUT"
run() {  # tree, name, benchmark script, args...
  local tree=$1 name=$2 script=$3; shift 3
  local root=$PWD; [ "$tree" = before ] && root=$(cd "$BEFORE" && pwd)
  (cd "$root" && PYTHONPATH=/tmp/site:$root/src python3 "benchmarks/$script" "$@" --out "$OUT/${tree}_${name}_$n.json" \
    > "$OUT/${tree}_${name}_$n.log" 2>&1) || echo "$tree $name $n failed: $(tail -3 "$OUT/${tree}_${name}_$n.log")"
}
for n in $(seq 1 "$REPEATS"); do
  for tree in before after; do
    case "${1:-}" in
      train) run $tree train_8b bench_train.py --shape 8b --kernels one --pointwise compiled --skip-naive --steps 15 ;;
      decode)
        run $tree round_bf16 bench_static_round.py --draft random --dtype bfloat16 --depth 5 --tree 8,8,64 \
          --draft-round compiled
        run $tree extract_embedded bench_extract.py --model embedded --conversations 400 --skip-naive ;;
      *) echo "usage: before_after_h200.sh train|decode" >&2; exit 2 ;;
    esac
  done
done
ls "$OUT"
