#!/usr/bin/env bash
# `regenerate --backend hf` on its two engines, side by side in one call on the GPU (device tool, after
# scripts/device.sh's staging): per-step time and a profile of each at the GPU demo's batch, then the GPU demo's
# regenerate stage (912 train prompts x N answers, temperature 0.7, top-p 0.95, <= 256 new tokens, batch 2048) and
# the same prompts greedy, each engine in turn. Writes $OUT/engines/*.
# Usage: bash scripts/device.sh bash benchmarks/regenerate_engines_gpu.sh
set -euo pipefail
OUT=${OUT:-/tmp/out}
DIR=$OUT/engines
N=${N:-3}
mkdir -p "$DIR" /tmp/regen
python3 benchmarks/profile_generate.py --batch 2048 --repeats "${REPEATS:-2}" --variants dynamic,eaglet \
  --out "$DIR/steps.json" 2>&1 | grep -v -i warn | grep -E "^(dynamic|eaglet) " || true
for round in 1 2; do
  for engine in generate static; do
    for mode in sampled greedy; do
      if [ "$mode" = sampled ]; then args=(--n "$N" --temperature 0.7 --top-p 0.95); else args=(--temperature 0); fi
      out=/tmp/regen/$engine-$mode-$round.jsonl
      rm -f "$out" "$out.manifest.json"
      python3 -m eaglet.cli regenerate demo --split train --out "$out" --max-new-tokens 256 --batch-size 2048 \
        --hf-engine "$engine" "${args[@]}" > /dev/null 2> "$DIR/$engine-$mode-$round.log"
      cp "$out.manifest.json" "$DIR/$engine-$mode-$round.manifest.json"
      python3 -c "import json,sys; m=json.load(open(sys.argv[1])); print(sys.argv[2], m['new_tokens_this_run'], m['seconds_this_run'], m['tokens_per_s'], m['hf_engine'])" \
        "$out.manifest.json" "$engine-$mode-$round"
    done
  done
done
python3 - "$DIR" <<'PY'
import json, sys
rows = lambda p: {r["id"]: r["messages"][-1]["content"] for r in map(json.loads, open(p))}
a, b = rows("/tmp/regen/generate-greedy-1.jsonl"), rows("/tmp/regen/static-greedy-1.jsonl")
same = sum(a[k] == b[k] for k in a)
stats = {}
for engine in ("generate", "static"):
    answers = [json.loads(l) for l in open(f"/tmp/regen/{engine}-sampled-1.jsonl")]
    stats[engine] = {"answers": len(answers), "distinct": len({r["messages"][-1]["content"] for r in answers}),
                     "mean_chars": round(sum(len(r["messages"][-1]["content"]) for r in answers) / len(answers), 1)}
record = {"greedy_same_answers": same, "greedy_answers": len(a), "sampled": stats}
print(json.dumps(record))
json.dump(record, open(f"{sys.argv[1]}/compare.json", "w"), indent=1)
PY
