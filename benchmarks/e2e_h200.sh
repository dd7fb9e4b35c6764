#!/usr/bin/env bash
# The end-to-end H200 numbers of benchmarks/RESULTS.md (issue 7), through scripts/device.sh on the device:
#   bash scripts/device.sh bash benchmarks/e2e_h200.sh demo    # `eaglet demo --scale gpu` (resumable: call again
#                                                              #  with the same command if the 10-minute call ends)
#   bash scripts/device.sh bash benchmarks/e2e_h200.sh evals   # the demo's draft: chain and tree, with and without
#                                                              #  static caches + CUDA graphs, same prompts
#   bash scripts/device.sh bash benchmarks/e2e_h200.sh round   # the demo's draft: time per graphed round, per part
#   DRAFT=/tmp/e2e/tau/draft bash scripts/device.sh bash benchmarks/e2e_h200.sh speedup  # issue 5's headline evals
#   bash scripts/device.sh bash benchmarks/e2e_h200.sh train-anchor  # 8B-shape step beside speculators 0.9.0's only
#   bash scripts/device.sh bash benchmarks/e2e_h200.sh train-graphs  # `eaglet train` at the demo's size, its step
#                                                              #  recorded as CUDA graphs and not, same store, same steps
#   bash scripts/device.sh bash benchmarks/e2e_h200.sh train   # training step, 8B shape (next to speculators 0.9.0) and demo size
#   bash scripts/device.sh bash benchmarks/e2e_h200.sh loss     # the TTT loss alone, fused vs autograd, demo + 8B sizes
#   bash scripts/device.sh bash benchmarks/e2e_h200.sh tau-data   # issue 4's τ run (configs/tau_h200.yaml):
#   bash scripts/device.sh bash benchmarks/e2e_h200.sh tau-train  #  data in one call, training in the next
# evals, round and speedup take DRAFT (default: the demo's draft; the τ run's is $WORK/tau/draft). tau-train takes
# TAU_MAX_STEPS (the cosine schedule's length; set it from the measured step rate so the schedule ends annealed
# when max_minutes stops the run).
# Results are copied under $OUT (the device tool brings them back). WORK defaults to /tmp/e2e.
set -uo pipefail
WORK=${WORK:-/tmp/e2e}
OUT=${OUT:-$WORK/out}
mkdir -p "$WORK" "$OUT"
DRAFT=${DRAFT:-$WORK/demo/draft}
TAU_CONFIG=benchmarks/configs/tau_h200.yaml
eaglet() { python3 -m eaglet.cli "$@"; }
case "${1:-}" in
  demo)
    # the log goes to $OUT as it is written: a device call ended at its limit still brings back how far it got
    # DEMO_CONFIG: a recipe to run instead of the shipped one (`eaglet run DEMO_CONFIG`)
    mkdir -p "$OUT/demo"
    if [ -n "${DEMO_CONFIG:-}" ]; then command=(run "$DEMO_CONFIG"); else command=(demo --scale gpu); fi
    /usr/bin/time -v timeout "${DEMO_LIMIT_S:-540}" python3 -m eaglet.cli "${command[@]}" --out "$WORK/demo" \
      > "$OUT/demo/log.txt" 2>&1
    tail -40 "$OUT/demo/log.txt"
    cp -r "$WORK/demo/run.json" "$WORK/demo/eval" "$WORK/demo/draft/metrics.jsonl" "$WORK/demo/draft/"*.png \
      "$WORK/demo/"*.manifest.json "$WORK/demo/export/vllm/README.md" "$OUT/demo/" 2>/dev/null
    [ -f "$WORK/demo/synthesized.jsonl" ] && cp "$WORK/demo/synthesized.jsonl" "$OUT/demo/"
    ;;
  train-anchor)
    # issue 32's side-by-side: eaglet's 8B-shape step (Llama-3's 128,256-token vocabulary, draft vocab 32,000;
    # train's GPU default; with one weight-gradient matmul per shared layer; replayed as one CUDA graph; both;
    # profiled) and speculators 0.9.0's step at the same shape, in one call. Needs
    # .device/specwhl and .device/specbench carried (../shared/anchors/speculators-0.9.0/README.md).
    # BENCH_EXTRA: more bench_train.py flags (--freeze-lm-head: speculators' frozen head, the same work per step).
    # Each variant in its own process (VARIANTS): a second CUDA-graph recording in one process once failed here.
    # FROZEN_HEAD_VARIANTS: these again with the draft's LM head frozen, as speculators 0.9.0 trains it (its
    # Eagle3 draft's lm_head has requires_grad False): the same work per step as the anchor's.
    # A train_step variant may name its attention layout: train_step@split (default: train's); and end in
    # :computed_top, its teacher as for a store without the target's argmax (the whole LM head every step).
    runs="${VARIANTS:-train_step one train_step+copied_in one+graph+deferred}"
    for variant in ${FROZEN_HEAD_VARIANTS:-}; do runs="$runs $variant:frozen_head"; done
    for run in $runs; do
      variant=${run%:frozen_head} frozen="" train_kernels="" top=""
      [ "$run" != "$variant" ] && frozen=--freeze-lm-head
      [[ "$variant" == *:computed_top ]] && top=--computed-teacher-argmax variant=${variant%:computed_top}
      [[ "$variant" == *@* ]] && train_kernels="--train-kernels ${variant#*@}" variant=${variant%@*}
      name=${run//+/_} name=${name//:/_} name=${name//@/_}
      python3 benchmarks/bench_train.py --shape 8b --kernels "${KERNELS:-one}" --pointwise compiled --graph --deferred \
        --skip-naive --steps 20 ${BENCH_EXTRA:-} $frozen $top $train_kernels --only "$variant" --profile \
        --out "$OUT/train_8b_h200_${name}.json" > "$OUT/train_8b_profile_${name}.txt" 2>&1
      grep -E '^\{"' "$OUT/train_8b_profile_${name}.txt" | head -1
    done
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/specsite .device/specwhl/*.whl 2>&1 | tail -2
    PYTHONPATH=/tmp/specsite timeout "${SPEC_LIMIT_S:-240}" python3 .device/specbench/bench_eagle3.py --shape 8b --ttt 7 \
      --draft-vocab 32000 --optimizers adamw --out "$OUT/speculators_8b_h200.json" 2>&1 | tail -8
    ;;
  train-graphs)
    # a small store of the embedded target's own answers (benchmarks/configs/train_graphs_h200.yaml), then `eaglet
    # train` on it at the GPU demo's settings, GRAPH_STEPS steps each: the step recorded as CUDA graphs (train's GPU
    # default) and --no-cuda-graphs, alternated REPEATS times; metrics.jsonl of each run copied to $OUT
    config=benchmarks/configs/train_graphs_h200.yaml
    for stage in regenerate prepare extract; do
      /usr/bin/time -f "$stage %e s" python3 -m eaglet.cli run $config --out "$WORK/graphs" --only $stage 2>&1 | tail -2
    done
    mkdir -p "$OUT/train_graphs"
    for repeat in $(seq "${REPEATS:-2}"); do
      for graphs in cuda-graphs no-cuda-graphs; do
        run="$WORK/graphs/train_${graphs}_$repeat"
        rm -rf "$run"
        /usr/bin/time -f "train --$graphs: %e s" python3 -m eaglet.cli train --store "$WORK/graphs/store" --out "$run" \
          --token-budget 16384 --lr 5e-4 --max-steps "${GRAPH_STEPS:-300}" --log-every 20 --eval-every 100 \
          --attention-kernels one --"$graphs" 2>&1 | tail -2
        cp "$run/metrics.jsonl" "$OUT/train_graphs/${graphs}_$repeat.jsonl"
      done
    done
    ;;
  evals)
    # the demo's draft on EVAL_PROMPTS held-out prompts, 128 new tokens, greedy, chain and tree, with the static
    # caches + CUDA graphs (eval's GPU default) and without (--cuda-graphs off: the dynamic-cache engine); each
    # eval times its baseline (the same engine without the draft) in the same process
    common=(--draft "$DRAFT" --max-prompts "${EVAL_PROMPTS:-16}" --max-new-tokens 128 --dtype "${EVAL_DTYPE:-float32}")
    for mode in chain tree; do
      if [ $mode = chain ]; then shape=(--mode chain --depth 5); else shape=(--mode tree --depth 6 --topk 8 --budget 48); fi
      for graphs in on off; do
        extra=(); [ $mode = chain ] && [ $graphs = on ] && extra=(--hf-generate-baseline)
        eaglet eval "${common[@]}" "${shape[@]}" "${extra[@]}" --cuda-graphs $graphs --out "$WORK/eval_${mode}_$graphs" 2>&1 | tail -3
        cp "$WORK/eval_${mode}_$graphs/report.json" "$OUT/eval_${mode}_graphs_${graphs}_${EVAL_DTYPE:-float32}.json"
      done
    done
    ;;
  round)
    # where a graphed round's time goes (target at 1 / D+1 / tree-size tokens, chain and tree draft graphs), both dtypes
    for dtype in float32 bfloat16; do
      python3 benchmarks/bench_static_round.py --draft "$DRAFT" --dtype $dtype --profile \
        --out "$OUT/static_round_$dtype.json" 2>&1 | tail -40
    done
    ;;
  train)
    # 8B shape: the one-kernel layout with the draft's pointwise work compiled (train's GPU default) and eager,
    # profiled, and the naive reference; then the demo size (the τ run's step) the same two ways, profiled; then
    # speculators 0.9.0's anchor (if staged) in the time left of TRAIN_BENCH_LIMIT_S. Profiles: train_*_profile.txt
    end=$((SECONDS + ${TRAIN_BENCH_LIMIT_S:-420}))
    python3 benchmarks/bench_train.py --shape 8b --kernels one --profile --out "$OUT/train_8b_h200.json" \
      > "$OUT/train_8b_profile.txt" 2>&1
    grep -E '^\{"' "$OUT/train_8b_profile.txt"; grep -E 'speedup' "$OUT/train_8b_h200.json"
    python3 benchmarks/bench_train.py --shape smollm --tokens 16384 --draft-vocab 32000 --kernels one --skip-naive \
      --profile --out "$OUT/train_demo_h200.json" > "$OUT/train_demo_profile.txt" 2>&1
    grep -E '^\{"' "$OUT/train_demo_profile.txt"
    [ -d /tmp/specsite ] && [ $((end - SECONDS)) -gt 60 ] && PYTHONPATH=/tmp/specsite timeout $((end - SECONDS)) \
      python3 /tmp/specbench/bench_eagle3.py --shape 8b --ttt 7 --draft-vocab 32000 --optimizers adamw \
      --out "$OUT/speculators_8b_h200.json" 2>&1 | tail -8
    ;;
  loss)
    python3 benchmarks/bench_loss.py --tokens 16384 --out "$OUT/loss_demo_h200.json" 2>&1 | grep -E '"ms"|speedup|peak'
    python3 benchmarks/bench_loss.py --tokens 2048 --out "$OUT/loss_8b_h200.json" 2>&1 | grep -E '"ms"|speedup|peak'
    ;;
  tau-data)
    for stage in regenerate prepare extract; do
      /usr/bin/time -f "$stage %e s, peak RSS %M KB" python3 -m eaglet.cli run $TAU_CONFIG --out "$WORK/tau" --only $stage 2>&1 | tail -4
    done
    mkdir -p "$OUT/tau"
    cp "$WORK/tau/run.json" "$WORK/tau/"*.manifest.json "$OUT/tau/" 2>/dev/null
    ;;
  tau-train)
    config=$TAU_CONFIG
    if [ -n "${TAU_MAX_STEPS:-}" ]; then
      config=$WORK/tau_h200.yaml
      sed "s/^  max_steps: [0-9]*/  max_steps: $TAU_MAX_STEPS/" $TAU_CONFIG > "$config"
    fi
    /usr/bin/time -f "train %e s, peak RSS %M KB" timeout "${TRAIN_LIMIT_S:-580}" \
      python3 -m eaglet.cli run "$config" --out "$WORK/tau" --only train 2>&1 | tail -12
    mkdir -p "$OUT/tau"
    cp "$WORK/tau/run.json" "$WORK/tau/draft/metrics.jsonl" "$WORK/tau/draft/"*.png "$OUT/tau/" 2>/dev/null
    ;;
  speedup)
    # issue 5's headline: DRAFT (the τ run's) at batch 1 on EVAL_PROMPTS held-out prompts, 128 tokens, graphed
    # fused rounds with the draft's part compiled (eval's GPU default): bf16 chain and trees, float32 tree (exact
    # lossless check); then a round's parts per tree shape (SPEEDUP_TREES, default 8,8,64) and the kernels its graph
    # replays (SPEEDUP_BENCH=0 skips it). SPEEDUP_RUNS: ';'-separated "dtype mode depth [topk budget]" (default below)
    common=(--draft "$DRAFT" --max-prompts "${EVAL_PROMPTS:-16}" --max-new-tokens 128 --cuda-graphs on)
    IFS=';' read -ra runs <<< "${SPEEDUP_RUNS:-float32 tree 8 8 64;bfloat16 tree 8 8 64;bfloat16 chain 5;bfloat16 tree 10 10 96}"
    for run in "${runs[@]}"; do
      set -- $run
      shape=(--mode "$2" --depth "$3"); [ "$2" = tree ] && shape+=(--topk "$4" --budget "$5")
      name="speedup_${1}_${2}_${3}${4:+_$4_$5}"
      eaglet eval "${common[@]}" --dtype "$1" "${shape[@]}" --out "$WORK/$name" 2>&1 | tail -2
      cp "$WORK/$name/report.json" "$OUT/$name.json"
    done
    [ "${SPEEDUP_BENCH:-1}" = 0 ] && exit 0  # evals only
    trees=(); for tree in ${SPEEDUP_TREES:-8,8,64}; do trees+=(--tree "$tree"); done
    python3 benchmarks/bench_static_round.py --draft "$DRAFT" --dtype bfloat16 "${trees[@]}" --draft-round compiled \
      --profile --out "$OUT/static_round_bfloat16.json" > "$OUT/static_round_profile.txt" 2>&1
    grep -E '_ms"|speedup|kernels' "$OUT/static_round_profile.txt"
    ;;
  *) echo "usage: bash benchmarks/e2e_h200.sh demo|evals|round|speedup|train|loss|tau-data|tau-train" >&2; exit 2 ;;
esac
