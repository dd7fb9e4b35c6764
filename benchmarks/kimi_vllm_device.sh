#!/usr/bin/env bash
# The tiny Kimi-K2.5-shaped checkpoint (tests/kimi.py) through vLLM on one GPU, end to end: one `eaglet run` of
# examples/kimi_tiny_1gpu_vllm.yaml (regenerate vllm -> prepare -> extract vllm -> train -> export -> eval served by
# vLLM), then eaglet's own eval of the same export, the vLLM store against a float32 transformers reference, and the
# exported draft's rope against the installed vLLM's get_rope. One part per device call (each well under 10 minutes;
# the run resumes where the last call stopped):
#   bash benchmarks/kimi_vllm_device.sh build|run|reference|evalhf|rope
# vLLM staged first (scripts/device/vllm_install.sh; docs/serving.md "GPU checks"), eaglet's missing wheels in .device/whl.
# Results: JSON under $OUT (kimi_*.json) and the run's report files copied there.
set -euo pipefail
export PYTHONPATH=/tmp/vllm-site:/tmp/site:$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 EAGLET_CACHE=/tmp/eaglet/cache
target=/tmp/eaglet-kimi-tiny  # where examples/kimi_tiny_1gpu_vllm.yaml looks for it
run=/tmp/kimi-run
mkdir -p "${OUT:=/tmp/out}" /tmp/eaglet
if [ -d .device/whl ] && [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/whl/*.whl && touch /tmp/site/.installed
fi
case "$1" in
  build)  # the checkpoint, made on this machine by the tests' own builder (compressed-tensors packs the experts)
    [ -f "$target/config.json" ] || python3 tests/kimi.py "$target"
    python3 -c "import json,sys; c=json.load(open('$target/config.json')); print(c['architectures'], c['text_config']['architectures'])"
    ;;
  run)  # the whole path as a user runs it; a later call resumes it (stages done are skipped)
    set +e
    /usr/bin/time -f "eaglet run: %e s" python3 -m eaglet.cli run examples/kimi_tiny_1gpu_vllm.yaml --out "$run" \
      2>&1 | grep -v "it/s\]$" | tee "$OUT/kimi_run.log" | tail -60
    status=${PIPESTATUS[0]}
    set -e
    for file in eval/report.json run.json; do [ -f "$run/$file" ] && cp "$run/$file" "$OUT/kimi_$(basename "$file")"; done
    exit "$status"
    ;;
  reference)  # the vLLM store beside a float32 transformers store of the same dequantized checkpoint
    rm -rf /tmp/kimi-ref
    python3 -m eaglet.cli extract --prepared "$run/prepared" --out /tmp/kimi-ref --backend hf --dtype float32 \
      --max-samples 256 2>&1 | tail -2
    python3 benchmarks/vllm_extract_parity.py compare /tmp/kimi-ref "$run/store" --common | tee "$OUT/kimi_parity.json"
    ;;
  evalhf)  # eaglet's own decoder on the same export and prompts (the target also fits transformers here)
    python3 -m eaglet.cli eval --draft "$run/export/vllm" --target "$target" --out /tmp/kimi-eval-hf --max-prompts 32 \
      --depth 4 --dtype bfloat16 2>&1 | tail -3
    cp /tmp/kimi-eval-hf/report.json "$OUT/kimi_eval_hf_report.json"
    ;;
  rope)  # the exported draft's cos/sin (eaglet's DraftRope) against this vLLM's get_rope for its config
    python3 benchmarks/rope_parity.py "$run/export/vllm" | tee "$OUT/kimi_rope.json"
    ;;
  *) echo "usage: $0 build|run|reference|evalhf|rope" >&2; exit 2 ;;
esac
