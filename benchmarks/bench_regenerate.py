"""Benchmark `eaglet regenerate --backend hf` next to plain batched `model.generate`, in one process.

Both decode the same prompts greedily with the same batch size and max new tokens. The baseline
batches prompts in file order (what a script would do); eaglet length-buckets them. Generated
tokens are counted up to and including each answer's end-of-turn token.
Usage: python benchmarks/bench_regenerate.py --target T [--prompts 512] [--max-new-tokens 256] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def plain_generate(model, tokenizer, prompts: list[str], batch_size: int, max_new_tokens: int, device: str) -> dict:
    import torch

    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # some transformers versions load this tokenizer without one
        tokenizer.pad_token = tokenizer.eos_token
    stop = tokenizer.eos_token_id
    new_tokens = 0
    torch.cuda.synchronize() if device.startswith("cuda") else None
    started = time.perf_counter()
    for begin in range(0, len(prompts), batch_size):
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts[begin : begin + batch_size]
        ]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.inference_mode():
            output = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=stop)
        for row in output[:, batch["input_ids"].shape[1] :].tolist():
            new_tokens += next((i + 1 for i, t in enumerate(row) if t == stop), len(row))
    torch.cuda.synchronize() if device.startswith("cuda") else None
    seconds = time.perf_counter() - started
    return {"new_tokens": new_tokens, "seconds": round(seconds, 3), "tokens_per_s": round(new_tokens / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="embedded")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--large-batch", type=int, default=256, help="also run eaglet at this batch size (0: skip)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch
    from rich.console import Console

    from eaglet.config import RegenerateConfig
    from eaglet.data.readers import Conversation, read_conversations
    from eaglet.data.regenerate import run_regenerate
    from eaglet.model.target import load_model, load_tokenizer, pick_device, resolve_target
    from eaglet.resources import demo_prompts_path

    rows = [r for r in read_conversations([demo_prompts_path()]) if isinstance(r, Conversation)]
    rows = [r for r in rows if r.meta.get("split") == "train"][: args.prompts]
    prompts = [r.messages[-1]["content"] for r in rows]
    device = pick_device("auto")
    resolved = resolve_target(args.target)
    tokenizer = load_tokenizer(resolved.path)
    model = load_model(resolved.path, device)
    plain_generate(model, tokenizer, prompts[:8], 8, 8, device)  # warm-up (CUDA context, kernels)
    baseline = plain_generate(model, tokenizer, prompts, args.batch_size, args.max_new_tokens, device)
    del model
    torch.cuda.empty_cache() if device.startswith("cuda") else None

    def ours(batch_size: int) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            result = run_regenerate(
                RegenerateConfig(
                    prompts=[str(demo_prompts_path())],
                    out=str(Path(tmp) / "a.jsonl"),
                    target=args.target,
                    split="train",
                    max_prompts=args.prompts,
                    max_new_tokens=args.max_new_tokens,
                    batch_size=batch_size,
                ),
                Console(stderr=True, quiet=True),
            )
        return {
            "batch_size": batch_size,
            "new_tokens": result.new_tokens,
            "seconds": round(result.seconds, 3),
            "tokens_per_s": round(result.new_tokens / result.seconds, 1),
        }

    same_batch = ours(args.batch_size)
    large_batch = ours(args.large_batch) if args.large_batch else None
    record = {
        "benchmark": "regenerate_hf",
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "plain_generate": baseline,
        "eaglet_regenerate": same_batch,
        "eaglet_regenerate_large_batch": large_batch,
        "ratio_same_batch": round(same_batch["tokens_per_s"] / baseline["tokens_per_s"], 3),
        "ratio_large_batch": round(large_batch["tokens_per_s"] / baseline["tokens_per_s"], 3) if large_batch else None,
    }
    print(json.dumps(record, indent=2))
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
