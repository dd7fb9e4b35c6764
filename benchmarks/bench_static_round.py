"""Where a static-cache speculative round spends its time: the target's graph at 1, D+1 and tree-size tokens,
the draft's chain and tree round graphs, and whole greedy chain and tree decodes; optionally the CUDA kernels
of the eager D+1 forward.

A round costs the draft's part plus one verification; the speedup over plain decoding is roughly
τ · t(target, 1 token) / (t(draft's part) + t(target, D+1 tokens)), so these three numbers explain it.
Usage: python benchmarks/bench_static_round.py --draft RUN/draft|random [--dtype float32|bfloat16] [--depth 5]
       [--tree 8,8,64 [--tree 10,10,96 ...]] [--draft-round compiled,eager] [--profile] [--out FILE.json]
``--draft random`` builds an untrained draft of the shape `eaglet train` gives the target (draft vocabulary
RANDOM_DRAFT_VOCAB): its rounds cost what a trained draft's cost, only τ differs, so a round can be timed
without training one first.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

PROMPT = list(range(100, 140))  # 40 prompt tokens
REPEATS = 50
DEFAULT_TREE = "8,8,64"
RANDOM_DRAFT_VOCAB = 32000  # train's default draft vocabulary, min(32000, V)


def random_draft(path, seed: int = 0):
    """An untrained draft shaped as `eaglet train` shapes one for the target at ``path``."""
    import torch

    from eaglet.formats.draft_config import DraftConfig
    from eaglet.formats.layers import default_aux_layer_ids
    from eaglet.model.draft import Eagle3Draft
    from eaglet.model.target import read_config

    target_config = read_config(path)
    vocab = min(RANDOM_DRAFT_VOCAB, int(target_config["vocab_size"]))
    config = DraftConfig.from_target(
        target_config, vocab, default_aux_layer_ids(int(target_config["num_hidden_layers"]))
    )
    torch.manual_seed(seed)
    return Eagle3Draft(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target", default="embedded")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--tree", action="append", help=f"tree depth,top-k,budget (repeatable; default {DEFAULT_TREE})")
    parser.add_argument(
        "--draft-round",
        default="compiled,eager",
        help="the draft's part of each round: compiled (eval's GPU default), eager, or both",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print the top CUDA kernels of an eager D+1 forward, the busiest host operations of a tree decode and the kernels its round graphs replay",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch

    from eaglet.decode.baseline import GreedyTargetSteps, static_target_decode, target_only_decode
    from eaglet.decode.chain import ChainRounds, StaticChainDraft, static_chain_decode
    from eaglet.decode.common import sync
    from eaglet.decode.static import StaticTarget
    from eaglet.decode.tree import StaticTreeDraft, TreeRounds, static_tree_decode
    from eaglet.model.draft import load_draft
    from eaglet.model.sampling import Sampling
    from eaglet.model.target import load_head_weights, load_model, pick_device, resolve_target

    device = torch.device(pick_device(args.device))
    path = resolve_target(args.target).path
    model = load_model(path, str(device), args.dtype)
    dtype = next(model.parameters()).dtype
    draft = random_draft(path) if args.draft == "random" else load_draft(args.draft)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(load_head_weights(path).embed.float())
    draft = draft.to(device, dtype=dtype).eval()
    layers = tuple(draft.config.eagle_aux_hidden_state_layer_ids)
    trees = [tuple(int(x) for x in spec.split(",")) for spec in (args.tree or [DEFAULT_TREE])]
    largest = max([args.depth + 1, 64] + [budget + 1 for _, _, budget in trees])
    max_len = len(PROMPT) + args.max_new_tokens + 2 * largest
    target = StaticTarget(model, layers, max_len, verify_tokens=largest)
    target.capture_all()
    steps = GreedyTargetSteps(target)
    static_target_decode(target, PROMPT, 16, set(), steps)  # warm-up: captures the baseline's step

    def ms(fn) -> float:
        sync(device)
        started = time.perf_counter()
        for _ in range(REPEATS):
            fn()
        sync(device)
        return round(1000 * (time.perf_counter() - started) / REPEATS, 3)

    record: dict = {
        "benchmark": "static_round",
        "device": str(device),
        "dtype": args.dtype,
        "depth": args.depth,
        "draft": args.draft,
        "cuda_graphs": target.graphs,
        "torch": torch.__version__,
    }
    target.reset()
    target.forward(PROMPT)
    base = target.length
    for size in sorted({1, args.depth + 1, *(budget + 1 for _, _, budget in trees)}):

        def forward(size=size):
            target.crop(base)
            target.forward(list(range(5, 5 + size)))

        record[f"target_forward_{size}_ms"] = ms(forward)
    baseline = target_only_decode(target, PROMPT, args.max_new_tokens, Sampling(), set())
    record["baseline_forwards_ms_per_token"] = round(1000 * baseline.seconds / len(baseline.tokens), 3)
    baseline = static_target_decode(target, PROMPT, args.max_new_tokens, set(), steps)
    record["baseline_ms_per_token"] = round(1000 * baseline.seconds / len(baseline.tokens), 3)  # eval's baseline
    one = torch.ones((), dtype=torch.long, device=device)

    def measure(name: str, static_draft, rounds, decode, verify_size: int) -> None:
        """The draft's part of a round alone, then whole decodes: a round's wall time against its parts timed
        alone (the difference is what the host and the acceptance add)."""
        decode(16)  # warm-up: compiles the draft's round, captures the round's graph
        tokens = torch.zeros(static_draft.rows, dtype=torch.long, device=device)
        aux = torch.zeros(static_draft.rows, len(layers), model.config.hidden_size, device=device, dtype=dtype)
        static_draft.reset()
        static_draft.length = len(PROMPT)
        draft_ms = record[f"{name}_draft_ms"] = ms(lambda: static_draft.round(tokens, aux, one))
        result = decode(args.max_new_tokens)
        record[f"{name}_tau"] = round(result.acceptance_length, 3)
        record[f"{name}_tokens_per_s"] = round(len(result.tokens) / result.seconds, 2)
        record[f"{name}_round_ms"] = round(1000 * result.seconds / result.forwards, 3)
        record[f"{name}_round_parts_ms"] = round(draft_ms + record[f"target_forward_{verify_size}_ms"], 3)
        record[f"{name}_speedup"] = round(record[f"{name}_tokens_per_s"] * record["baseline_ms_per_token"] / 1000, 3)

    for variant in args.draft_round.split(","):
        compiled = variant == "compiled"
        chain_draft = StaticChainDraft(draft, max_len, args.depth, compiled=compiled)
        chain_rounds = ChainRounds(target, chain_draft)
        measure(
            f"chain_{args.depth}_{variant}",
            chain_draft,
            chain_rounds,
            lambda n: static_chain_decode(target, chain_draft, PROMPT, n, set(), chain_rounds),
            args.depth + 1,
        )
        for depth, topk, budget in trees:
            tree_draft = StaticTreeDraft(draft, max_len, depth, topk, budget, compiled=compiled)
            tree_rounds = TreeRounds(target, tree_draft)
            measure(
                f"tree_{depth}_{topk}_{budget}_{variant}",
                tree_draft,
                tree_rounds,
                lambda n: static_tree_decode(target, tree_draft, PROMPT, n, set(), tree_rounds),
                tree_draft.budget + 1,
            )
    print(json.dumps(record, indent=2))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        eager = StaticTarget(model, layers, max_len, graphs=False)
        eager.reset()
        eager.forward(PROMPT)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                eager.crop(len(PROMPT))
                eager.forward(list(range(5, 6 + args.depth)))
            sync(device)
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total" if device.type == "cuda" else "cpu_time_total",
                row_limit=12,
                max_name_column_width=70,
            )
        )
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:  # the tree loop's host work
            result = static_tree_decode(target, tree_draft, PROMPT, 32, set(), tree_rounds)  # the last tree measured
        events = prof.key_averages()
        print(events.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))
        # the kernels the rounds' graphs replay (CUPTI records them one by one): where a round's GPU time goes
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        launches = sum(e.count for e in kernels)
        gpu_us = sum(e.self_device_time_total for e in kernels)
        print(
            f"tree decode: {result.forwards} rounds, {launches / result.forwards:.0f} kernels and "
            f"{gpu_us / 1000 / result.forwards:.3f} ms of kernel time per round (prefill included)"
        )
        print(events.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90))
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
