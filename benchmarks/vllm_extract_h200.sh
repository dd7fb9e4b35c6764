#!/usr/bin/env bash
# `eaglet extract --backend vllm` beside `--backend hf` and vLLM's own prefill, on the H200 (one part per device call).
# Staged first: the embedded target (scripts/device.sh) and vLLM (scripts/device/vllm_install.sh; docs/serving.md "GPU checks").
#   bash scripts/device.sh bash benchmarks/vllm_extract_h200.sh data|smoke|regen|embedded|8b|route|ratio|ratios|profile|moe|int4|train|serve
# Results: one JSON object per line in $OUT/vllm_extract.jsonl (python benchmarks/vllm_extract_parity.py prints them).
set -euo pipefail
export PYTHONPATH=/tmp/vllm-site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
work=/tmp/vx
repeats=${REPEATS:-3}  # extractions (and prefills) per process, the target loaded once: median and spread
# the stores in memory when /dev/shm holds them (STORES=/tmp/vx/disk to measure with the disk): the route's own
# rate, apart from the disk's (~1.1 GB/s on the H200 machine, below what vLLM's prefill of a small target produces)
if [ -z "${STORES:-}" ] && [ "$(df -k --output=avail /dev/shm 2>/dev/null | tail -1)" -gt $((40 * 1024 * 1024)) ]; then
  STORES=/dev/shm/vx
fi
stores=${STORES:-$work}
mkdir -p "$work" "$stores" "${OUT:=/tmp/out}"
echo "stores in $stores ($(df -h --output=avail "$stores" | tail -1) free)" >&2
embedded=$(python3 -m eaglet.cli target info --json | python3 -c "import json,sys; print(json.load(sys.stdin)['path'])")
bench() {  # the results are the JSON lines, one per size (vLLM logs its shutdown to stdout after them)
  python3 benchmarks/vllm_extract_parity.py "$@" | grep '^{"' | tee -a "$OUT/vllm_extract.jsonl"
}
pair() {  # pair NAME TARGET SAMPLES: both backends, vLLM's prefill alone over the same samples, the features compared
  local name=$1 target=$2 samples=$3
  rm -rf "$stores/$name-hf" "$stores/$name-vllm"
  bench extract --repeats "$repeats" --backend hf --target "$target" --prepared "$work/prepared" \
    --out "$stores/$name-hf" --max-samples "$samples"
  bench extract --repeats "$repeats" --backend vllm --target "$target" --prepared "$work/prepared" \
    --out "$stores/$name-vllm" --max-samples "$samples"
  bench prefill --repeats "$repeats" --target "$target" --prepared "$work/prepared" --max-samples "$samples"
  bench compare "$stores/$name-hf" "$stores/$name-vllm"
}
case "$1" in
  data)  # the target's own answers to the demo's train prompts (ANSWERS each, default 1: 912 samples; 4 gives 3,648
    # for rates that the fixed costs of a run — the engine's ramp, the last shard's drain — weigh less on)
    # REGEN_BACKEND=vllm writes them through vLLM's engine (the streamed feed), hf (default) through transformers
    rm -f "$work/answers.jsonl" "$work/answers.jsonl.manifest.json"
    /usr/bin/time -f "regenerate --backend ${REGEN_BACKEND:-hf}: %e s" python3 -m eaglet.cli regenerate demo \
      --split train --n "${ANSWERS:-1}" --temperature 0.7 --top-p 0.95 --max-new-tokens 256 --batch-size 2048 \
      --backend "${REGEN_BACKEND:-hf}" --out "$work/answers.jsonl" 2>&1 | tail -2
    [ -s "$work/answers.jsonl" ]
    python3 -m eaglet.cli prepare "$work/answers.jsonl" --out "$work/prepared"
    ;;
  smoke)  # the vllm backend on 64 samples: the connector's path end to end, before the long runs
    bench extract --backend vllm --target "$embedded" --prepared "$work/prepared" --out "$stores/smoke" \
      --max-samples 64
    bench compare "$stores/smoke" "$stores/smoke"
    rm -rf "$stores/smoke"
    ;;
  regen)  # the demo's train prompts answered greedily by each in-process backend: tok/s and identical answers
    for backend in hf vllm; do
      rm -f "$work/regen-$backend.jsonl" "$work/regen-$backend.jsonl.manifest.json"
      python3 -m eaglet.cli regenerate demo --split train --n 1 --max-new-tokens 256 --backend "$backend" \
        --batch-size 2048 --out "$work/regen-$backend.jsonl" | tail -1
    done
    python3 benchmarks/vllm_extract_parity.py answers "$work/regen-hf.jsonl" "$work/regen-vllm.jsonl" \
      | tee -a "$OUT/vllm_extract.jsonl"
    ;;
  embedded)  # + a float32 hf store: which bf16 backend is nearer the exact features
    pair embedded "$embedded" 100000
    rm -rf "$stores/embedded-f32"
    bench extract --backend hf --dtype float32 --target "$embedded" --prepared "$work/prepared" \
      --out "$stores/embedded-f32"
    bench compare "$stores/embedded-f32" "$stores/embedded-hf"
    bench compare "$stores/embedded-f32" "$stores/embedded-vllm"
    ;;
  8b)
    [ -f "$work/llama8b/config.json" ] || bench make-8b "$work/llama8b" --tokenizer "$embedded"
    pair llama8b "$work/llama8b" "${SAMPLES:-500}"
    rm -rf "$stores/llama8b-hf" "$stores/llama8b-vllm"
    ;;
  route)  # where the vllm backend's time goes beyond vLLM's prefill: the same engine saving nothing, side by side
    [ -f "$work/llama8b/config.json" ] || bench make-8b "$work/llama8b" --tokenizer "$embedded"
    rm -rf "$stores/llama8b-vllm"
    bench extract --repeats "$repeats" --backend vllm --target "$work/llama8b" --prepared "$work/prepared" \
      --out "$stores/llama8b-vllm" --max-samples "${SAMPLES:-912}"
    for route in --route ""; do  # the route first: vLLM's plain prefill is steady across calls (43.4-43.8k)
      bench prefill --repeats "$repeats" --target "$work/llama8b" --prepared "$work/prepared" \
        --max-samples "${SAMPLES:-912}" $route
    done
    rm -rf "$stores/llama8b-vllm"
    ;;
  ratios)  # the vllm backend, vLLM's plain prefill and transformers' bare forward at each of SIZES samples (default 912,3648): each through one
    # engine started once, so both sizes fit one device call after `data` (an 8B engine's start is ~100 s)
    [ -f "$work/llama8b/config.json" ] || bench make-8b "$work/llama8b" --tokenizer "$embedded"
    rm -rf "$stores/llama8b-vllm"
    bench extract --repeats "$repeats" --sizes "${SIZES:-912,3648}" --backend vllm --target "$work/llama8b" \
      --prepared "$work/prepared" --out "$stores/llama8b-vllm"
    bench prefill --repeats "$repeats" --sizes "${SIZES:-912,3648}" --target "$work/llama8b" --prepared "$work/prepared"
    rm -rf "$stores/llama8b-vllm"
    # plain transformers' forward over the same samples: the bare forward issue 32's extraction MFU is measured against
    bench bare --repeats "$repeats" --sizes "${SIZES:-912,3648}" --target "$work/llama8b" --prepared "$work/prepared"
    ;;
  ratio)  # the vllm backend and vLLM's plain prefill alone, side by side (route's two ends, one engine start fewer)
    [ -f "$work/llama8b/config.json" ] || bench make-8b "$work/llama8b" --tokenizer "$embedded"
    rm -rf "$stores/llama8b-vllm"
    bench extract --repeats "$repeats" --backend vllm --target "$work/llama8b" --prepared "$work/prepared" \
      --out "$stores/llama8b-vllm" --max-samples "${SAMPLES:-912}"
    bench prefill --repeats "$repeats" --target "$work/llama8b" --prepared "$work/prepared" --max-samples "${SAMPLES:-912}"
    rm -rf "$stores/llama8b-vllm"
    ;;
  profile)  # where the vllm backend's time goes: vLLM's profiler on its worker during one more run of the backend
    # and of plain prefill, each after a timed run; traces under $OUT/profile-*, their summaries in the jsonl
    [ -f "$work/llama8b/config.json" ] || bench make-8b "$work/llama8b" --tokenizer "$embedded"
    rm -rf "$stores/llama8b-vllm" "$OUT/profile-extract" "$OUT/profile-prefill"
    bench extract --repeats 1 --profile "$OUT/profile-extract" --backend vllm --target "$work/llama8b" \
      --prepared "$work/prepared" --out "$stores/llama8b-vllm" --max-samples "${SAMPLES:-912}"
    bench prefill --repeats 1 --profile "$OUT/profile-prefill" --target "$work/llama8b" --prepared "$work/prepared" \
      --max-samples "${SAMPLES:-912}"
    for part in extract prefill; do
      python3 benchmarks/vllm_profile_summary.py "$OUT/profile-$part" | sed "s/^{/{\"profiled\": \"$part\", /" \
        | tee -a "$OUT/vllm_extract.jsonl"
    done
    rm -rf "$stores/llama8b-vllm"
    ;;
  moe)
    [ -f "$work/moe/config.json" ] || bench make-moe "$work/moe" --tokenizer "$embedded"
    pair moe "$work/moe" 500
    ;;
  int4)  # compressed-tensors INT4: vLLM runs the packed weights (Marlin), transformers dequantizes them at load
    [ -f "$work/int4/config.json" ] || bench make-int4 "$work/int4" --tokenizer "$embedded"
    pair int4 "$work/int4" 500
    ;;
  train)  # a draft on each embedded store, the same recipe; eaglet eval decodes the held-out demo prompts
    for backend in hf vllm; do
      rm -rf "$work/draft-$backend"
      python3 -m eaglet.cli train --store "$stores/embedded-$backend" --out "$work/draft-$backend" --token-budget 16384 \
        --lr 0.0005 --max-steps 600 --eval-every 200 --log-every 100 --seed 0 | tail -3
      python3 -m eaglet.cli eval --draft "$work/draft-$backend" --max-prompts 32 --max-new-tokens 128 --mode chain \
        --depth 5 --dtype bfloat16 --out "$work/eval-$backend" | tail -4
      python3 -c "import json; r=json.load(open('$work/eval-$backend/report.json')); \
evals=[e for e in map(json.loads, open('$work/draft-$backend/metrics.jsonl')) if e.get('kind') == 'eval']; \
print(json.dumps({'draft_from': '$backend', 'acceptance_length': r['acceptance_length'], 'speedup': r['speedup'], \
'lossless': r['lossless'], 'heldout_sim_tau': evals[-1]['tau'] if evals else None}))" | tee -a "$OUT/vllm_extract.jsonl"
    done
    ;;
  serve)  # a draft (DRAFT, default the hf-store one) exported both ways, served by vLLM (compiled) beside `eaglet
    # eval` at the same k, on held-out prompts of the demo's file and of MT-Bench's (written elsewhere)
    k=3 draft=${DRAFT:-$work/draft-hf}
    for format in vllm speculators; do
      python3 -m eaglet.cli export --draft "$draft" --format "$format" --out "$work/export-$format" \
        --verifier "$embedded" --speculative-tokens $k --overwrite | tail -1
    done
    python3 benchmarks/vllm_serve_export.py --target "$embedded" --export "$work/export-vllm" \
      "$work/export-speculators" --k $k --sources demo mt-bench --prompts 16 --batch1-prompts 4 \
      --repeats "${REPEATS:-3}" --write-prompts "$work/serve_prompts" \
      --out "$OUT/vllm_serve.json" > "$OUT/vllm_serve.out"  # to a file: a call cut at its limit keeps what was printed
    rm -rf "$work/eval-serve"
    python3 -m eaglet.cli eval --draft "$draft" --prompts "$work/serve_prompts/demo.jsonl" \
      --prompts "$work/serve_prompts/mt-bench.jsonl" --split all --mode chain --depth $k --max-new-tokens 128 \
      --dtype bfloat16 --out "$work/eval-serve" | tail -4
    cp "$work/eval-serve/report.json" "$OUT/eaglet_eval_serve_prompts.json"
    ;;
  *) echo "usage: $0 data|smoke|regen|embedded|8b|route|ratio|ratios|profile|moe|int4|train|serve" >&2; exit 2 ;;
esac
