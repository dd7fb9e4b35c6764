"""The CPU TTT step (dense attention) with the K steps' attention weights kept for the backward against recomputed
in it, at the embedded target's draft shape: seconds per forward + backward (memory: bench_online.py).

    python benchmarks/bench_ttt_recompute.py --tokens 1024 [--draft-vocab 4096] [--steps 7] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import eaglet.train.ttt as ttt
from eaglet.formats.draft_config import DraftConfig
from eaglet.formats.layers import default_aux_layer_ids
from eaglet.model.draft import Eagle3Draft
from eaglet.model.target import read_config, resolve_target


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="embedded")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--draft-vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    target = read_config(resolve_target(args.target).path)
    config = DraftConfig.from_target(target, args.draft_vocab, default_aux_layer_ids(int(target["num_hidden_layers"])))
    torch.manual_seed(0)
    draft = Eagle3Draft(config)
    tokens = args.tokens
    inputs = ttt.TTTInputs(
        input_ids=torch.randint(0, config.vocab_size, (tokens,)),
        aux=torch.randn(tokens, 3, config.target_hidden_size),
        loss_mask=torch.ones(tokens, dtype=torch.bool),
        doc_ids=torch.zeros(tokens, dtype=torch.long),
        positions=torch.arange(tokens),
        doc_end=torch.full((tokens,), tokens),
        teacher_logits=torch.randn(tokens, args.draft_vocab),
        teacher_in_vocab=torch.ones(tokens, dtype=torch.bool),
    )
    report = {
        "tokens": tokens,
        "draft_vocab": args.draft_vocab,
        "ttt_steps": args.steps,
        "threads": torch.get_num_threads(),
    }
    for name, bound in (("kept", 1 << 62), ("recomputed", 0), ("kept", 1 << 62), ("recomputed", 0)):
        ttt.ATTENTION_KEEP_BYTES = bound
        seconds = []
        for _ in range(args.repeats + 1):  # the first is a warm-up
            started = time.perf_counter()
            ttt.ttt_forward(draft, inputs, args.steps).loss.backward()
            seconds.append(time.perf_counter() - started)
            draft.zero_grad()
        report.setdefault(f"{name}_step_s", []).append(round(statistics.median(seconds[1:]), 3))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
