"""τ of a draft for several tree shapes, on the prompts `eaglet eval` takes, without timing a baseline: which shape
to evaluate on the GPU. Greedy, float32, the dynamic-cache engine (its trees equal the static rounds', tested).
Usage: python benchmarks/bench_tree_shapes.py --draft RUN/draft [--max-prompts 16] [--max-new-tokens 128]
       --tree 8,8,64 --tree 9,8,64 ... [--out FILE.jsonl]
Prints one JSON line per shape: τ (tokens per target forward, as eval counts it), tokens, forwards, seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target", default="embedded")
    parser.add_argument("--max-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree", action="append", required=True, help="depth,top-k,budget (repeatable)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from eaglet.config import EvalConfig
    from eaglet.decode.evaluate import _prompts
    from eaglet.decode.runners import DraftRunner, TargetRunner
    from eaglet.decode.tree import tree_decode
    from eaglet.model.draft import load_draft
    from eaglet.model.target import load_head_weights, load_model, load_tokenizer, pick_device, resolve_target

    resolved = resolve_target(args.target)
    tokenizer = load_tokenizer(resolved.path)
    prompts = _prompts(
        EvalConfig(draft=args.draft, out="-", target=args.target, max_prompts=args.max_prompts), tokenizer
    )
    device = pick_device(args.device)
    model = load_model(resolved.path, device, "float32")
    draft = load_draft(args.draft, embed=load_head_weights(resolved.path).embed.float()).to(device).eval()
    target, drafts = TargetRunner(model, tuple(draft.config.eagle_aux_hidden_state_layer_ids)), DraftRunner(draft)
    stop = {tokenizer.eos_token_id}
    lines = []
    for spec in args.tree:
        depth, topk, budget = (int(x) for x in spec.split(","))
        started, tokens, forwards = time.perf_counter(), 0, 0
        for _, _, ids in prompts:
            result = tree_decode(target, drafts, ids, args.max_new_tokens, depth, topk, budget, stop)
            tokens, forwards = tokens + len(result.tokens), forwards + result.forwards
        lines.append(
            json.dumps(
                {
                    "tree": spec,
                    "tau": round(tokens / forwards, 3),
                    "tokens": tokens,
                    "forwards": forwards,
                    "seconds": round(time.perf_counter() - started, 1),
                }
            )
        )
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
