#!/usr/bin/env bash
# EAGLE-3 against EAGLE 3.1 (train --eagle-version), same store, same steps, same prompts, on one GPU (issue 59):
#   bash scripts/device.sh bash benchmarks/eagle31_device.sh data     # the GPU demo's data up to the stores
#   bash scripts/device.sh bash benchmarks/eagle31_device.sh train    # both drafts, trained side by side
#   bash scripts/device.sh bash benchmarks/eagle31_device.sh eval     # eaglet's decoder: chain k=DEPTH, bf16
#   bash scripts/device.sh bash benchmarks/eagle31_device.sh vllm     # vLLM serves each (staged: vllm_install.sh)
# STEPS (default 2000) optimizer steps each, the demo recipe's training settings otherwise; DEPTH (default 3) draft
# tokens per round in both decoders; MAX_PROMPTS (default 24) of each prompt file. Each part resumes or skips what is
# done. Results (JSON) under $OUT.
set -uo pipefail
WORK=${WORK:-/tmp/eagle31}
OUT=${OUT:-$WORK/out}
STEPS=${STEPS:-2000}
DEPTH=${DEPTH:-3}
MAX_PROMPTS=${MAX_PROMPTS:-24}
VERSIONS=(3 3.1)
mkdir -p "$WORK" "$OUT"
export PYTHONPATH=/tmp/vllm-site:${PYTHONPATH:-} VLLM_USE_FLASHINFER_SAMPLER=0
eaglet() { python3 -m eaglet.cli "$@"; }
prompts=(--prompts demo --prompts mt-bench --prompts "$WORK/data/synthesized.jsonl")
case "${1:-}" in
  data)  # the data stages alone (a run always has train and export; the config sets eval: null)
    for stage in synthesize regenerate prepare extract; do
      /usr/bin/time -f "$stage: %e s" python3 -m eaglet.cli run benchmarks/configs/eagle31_data.yaml \
        --out "$WORK/data" --only "$stage" 2>&1 | grep -v "it/s\]$" | tail -4
    done
    ;;
  train)  # one after the other (two at once: the second ran out of memory beside the first's CUDA graphs)
    for version in "${VERSIONS[@]}"; do
      /usr/bin/time -f "train $version: %e s" python3 -m eaglet.cli train --store "$WORK/data/store" \
        --eval-store "$WORK/data/store_heldout" --out "$WORK/draft-$version" --eagle-version "$version" \
        --token-budget 16384 --lr 0.0005 --max-steps "$STEPS" --attention-kernels one --eval-every 500 \
        --log-every 50 --seed 0 > "$OUT/train-$version.log" 2>&1
    done
    for version in "${VERSIONS[@]}"; do
      grep -v "it/s\]$" "$OUT/train-$version.log" | tail -8
      cp "$WORK/draft-$version/metrics.jsonl" "$OUT/metrics-$version.jsonl" 2>/dev/null
    done
    ;;
  eval)
    for version in "${VERSIONS[@]}"; do
      [ -d "$WORK/export-$version" ] || eaglet export --draft "$WORK/draft-$version" --format vllm \
        --out "$WORK/export-$version" 2>&1 | tail -2
      eaglet eval --draft "$WORK/export-$version" "${prompts[@]}" --max-prompts "$MAX_PROMPTS" \
        --max-new-tokens 128 --mode chain --depth "$DEPTH" --dtype bfloat16 --out "$WORK/eval-$version" 2>&1 | tail -4
      cp "$WORK/eval-$version/report.json" "$OUT/eval-eaglet-$version.json"
    done
    ;;
  vllm)
    for version in "${VERSIONS[@]}"; do
      eaglet eval --backend vllm --draft "$WORK/export-$version" "${prompts[@]}" \
        --max-prompts "$MAX_PROMPTS" --max-new-tokens 128 --depth "$DEPTH" --out "$WORK/vllm-$version" 2>&1 \
        | grep -v "it/s\]$" | tail -6
      cp "$WORK/vllm-$version/report.json" "$OUT/eval-vllm-$version.json"
    done
    ;;
  *) echo "usage: $0 data|train|eval|vllm" >&2; exit 2 ;;
esac
