"""Where a large batch of sampled generation spends its time on the GPU: `regenerate --backend hf`'s call
(`model.generate` on a dynamic cache) profiled, beside the same call on transformers' static cache (which
transformers compiles), on the demo's prompts with the demo's sampling.

Usage (device): bash scripts/device.sh python3 benchmarks/profile_generate.py --batch 2048 --out $OUT/gen.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="embedded")
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--profile-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--variants", default="dynamic,eaglet")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch

    from eaglet.data.readers import Conversation, read_conversations
    from eaglet.data.regenerate import encode_prompt
    from eaglet.model.batch_sampler import left_padded
    from eaglet.model.target import decoding_attention, load_model, load_tokenizer, resolve_target
    from eaglet.resources import demo_prompts_path

    rows = [r for r in read_conversations([demo_prompts_path()]) if isinstance(r, Conversation)]
    rows = [r for r in rows if r.meta.get("split") == "train"]
    resolved = resolve_target(args.target)
    tokenizer = load_tokenizer(resolved.path)
    model = load_model(resolved.path, args.device)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    encoded = [encode_prompt(tokenizer, SimpleNamespace(messages=r.prompt_messages)) for r in rows]
    encoded = sorted((encoded * (args.batch // len(encoded) + 1))[: args.batch], key=len)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, real = left_padded(encoded, pad)  # as the engines pad
    width = ids.shape[1]
    ids, mask = ids.to(args.device), real.long().to(args.device)
    stop = model.generation_config.eos_token_id

    def generate(max_new: int, **extra):
        torch.manual_seed(0)
        with torch.inference_mode(), decoding_attention():
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                do_sample=True,
                temperature=0.7,
                top_p=0.95,
                top_k=None,
                eos_token_id=stop,
                pad_token_id=pad,
                **extra,
            )

    from eaglet.data.generation import Generator

    engine = Generator(
        tokenizer,
        model,
        ids.device,
        len(encoded),
        [stop] if isinstance(stop, int) else stop,
        pad,
        True,
        engine="static",
    )

    def timed(max_new: int, **extra) -> dict:
        sync()
        started = time.perf_counter()
        if "eaglet" in extra:  # the static engine, sampled as the demo samples or greedy (its forward alone)
            temperature = 0.7 if extra["eaglet"] == "sampled" else 0.0
            steps = len(engine.sample(encoded, max_new, temperature, 0.95, seed=0)[0])
        else:
            steps = generate(max_new, **extra).shape[1] - width
        sync()
        seconds = time.perf_counter() - started
        return {"seconds": round(seconds, 3), "steps": steps, "ms_per_step": round(1000 * seconds / steps, 2)}

    record: dict = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "batch": len(encoded),
        "prompt_width": width,
        "max_new_tokens": args.max_new_tokens,
    }
    generate(4)  # CUDA context, cuBLAS handles
    for variant in args.variants.split(","):
        extra = {
            "static": {"cache_implementation": "static"},
            "eaglet": {"eaglet": "sampled"},
            "eaglet-greedy": {"eaglet": "greedy"},
        }.get(variant, {})
        first = timed(args.max_new_tokens, **extra)
        runs = [timed(args.max_new_tokens, **extra) for _ in range(args.repeats)]
        record[variant] = {
            "first": first,
            "runs": runs,
            "median_ms_per_step": statistics.median(r["ms_per_step"] for r in runs),
        }
        print(variant, json.dumps(record[variant]), flush=True)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
            timed(args.profile_steps, **extra)
        events = prof.key_averages()
        record[variant]["profile"] = {
            "steps": args.profile_steps,
            "cuda_ms_total": round(sum(e.self_device_time_total for e in events) / 1000, 2),
            "top": [
                (e.key, round(e.self_device_time_total / 1000, 2), e.count)
                for e in sorted(events, key=lambda e: -e.self_device_time_total)[:20]
            ],
        }
    print(json.dumps(record, indent=1))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
