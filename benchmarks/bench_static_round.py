"""Where a static-cache speculative round spends its time: the target's graph at 1, D+1 and tree-size tokens,
the draft's chain and tree round graphs, and whole greedy chain and tree decodes; optionally the CUDA kernels
of the eager D+1 forward.

A round costs one draft graph plus one verification; the speedup over plain decoding is roughly
τ · t(target, 1 token) / (t(draft round) + t(target, D+1 tokens)), so these three numbers explain it.
Usage: python benchmarks/bench_static_round.py --draft RUN/draft [--dtype float32|bfloat16] [--depth 5]
       [--tree 6,8,48] [--profile] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

PROMPT = list(range(100, 140))  # 40 prompt tokens
REPEATS = 50


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target", default="embedded")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--tree", default="6,8,48", help="tree depth,top-k,budget for the tree figures")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels of an eager D+1 forward")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch

    from eaglet.decode.engine import _sync
    from eaglet.decode.static import StaticTarget
    from eaglet.decode.static_draft import StaticDraft, static_chain_decode
    from eaglet.decode.static_tree import StaticTreeDraft, static_tree_decode
    from eaglet.draft import load_draft
    from eaglet.target import load_head_weights, load_model, pick_device, resolve_target

    device = torch.device(pick_device(args.device))
    path = resolve_target(args.target).path
    model = load_model(path, str(device), args.dtype)
    dtype = next(model.parameters()).dtype
    draft = load_draft(args.draft, embed=load_head_weights(path).embed.float()).to(device, dtype=dtype).eval()
    layers = tuple(draft.config.eagle_aux_hidden_state_layer_ids)
    tree_depth, tree_topk, tree_budget = (int(x) for x in args.tree.split(","))
    max_len = len(PROMPT) + args.max_new_tokens + 2 * max(args.depth + 1, tree_budget + 1, 64)
    target = StaticTarget(model, layers, max_len, verify_tokens=max(args.depth, tree_budget) + 1)
    target.capture_all()
    static_draft = StaticDraft(draft, max_len, args.depth)
    static_chain_decode(target, static_draft, PROMPT, 16, set())  # warm-up: captures the round graphs
    tree_draft = StaticTreeDraft(draft, max_len, tree_depth, tree_topk, tree_budget)
    static_tree_decode(target, tree_draft, PROMPT, 16, set())

    def ms(fn) -> float:
        _sync(device)
        started = time.perf_counter()
        for _ in range(REPEATS):
            fn()
        _sync(device)
        return round(1000 * (time.perf_counter() - started) / REPEATS, 3)

    record: dict = {"benchmark": "static_round", "device": str(device), "dtype": args.dtype, "depth": args.depth,
                    "cuda_graphs": target.graphs, "torch": torch.__version__}
    target.reset()
    target.forward(PROMPT)
    base = target.length
    for size in (1, args.depth + 1, tree_draft.budget + 1):
        def forward(size=size):
            target.crop(base)
            target.forward(list(range(5, 5 + size)))
        record[f"target_forward_{size}_ms"] = ms(forward)
    rows = args.depth + 1
    tokens = torch.zeros(rows, dtype=torch.long, device=device)
    aux = torch.zeros(rows, len(layers), model.config.hidden_size, device=device, dtype=dtype)
    one = torch.ones((), dtype=torch.long, device=device)
    static_draft.reset()
    static_draft.length = len(PROMPT)
    record["draft_round_ms"] = ms(lambda: static_draft.round(tokens, aux, one))
    tree_rows = tree_draft.rows
    tree_tokens = torch.zeros(tree_rows, dtype=torch.long, device=device)
    tree_aux = torch.zeros(tree_rows, len(layers), model.config.hidden_size, device=device, dtype=dtype)
    tree_draft.reset()
    tree_draft.length = len(PROMPT)
    record["tree_draft_round_ms"] = ms(lambda: tree_draft.round(tree_tokens, tree_aux, one))
    result = static_chain_decode(target, static_draft, PROMPT, args.max_new_tokens, set())
    record["chain_tokens_per_s"] = round(len(result.tokens) / result.seconds, 2)
    record["chain_tau"] = round(result.acceptance_length, 3)
    result = static_tree_decode(target, tree_draft, PROMPT, args.max_new_tokens, set())
    record["tree_tokens_per_s"] = round(len(result.tokens) / result.seconds, 2)
    record["tree_tau"] = round(result.acceptance_length, 3)
    print(json.dumps(record, indent=2))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        eager = StaticTarget(model, layers, max_len, graphs=False)
        eager.reset()
        eager.forward(PROMPT)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                eager.crop(len(PROMPT))
                eager.forward(list(range(5, 5 + rows)))
            _sync(device)
        print(prof.key_averages().table(sort_by="cuda_time_total" if device.type == "cuda" else "cpu_time_total",
                                        row_limit=12, max_name_column_width=70))
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
