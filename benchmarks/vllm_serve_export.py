"""An eaglet export served by vLLM itself: greedy outputs with and without the draft, vLLM's own acceptance
counters, tokens/s at batch 1 and at a batch of all prompts.

Usage (on the GPU machine, vLLM installed by scripts/device/vllm_install.sh):
  python benchmarks/vllm_serve_export.py --target DIR --export DIR [--k 3] [--prompts 16] [--max-new-tokens 128]
      [--out FILE.json] [--write-prompts FILE.jsonl]
The prompts are the shipped demo prompts' held-out split, rendered with the target's chat template (what `eaglet
eval --prompts demo` decodes), so vLLM's mean acceptance length compares with eval's chain τ at depth k.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import sys
import time
from pathlib import Path

HANG_DUMP_S = 240  # a silent engine prints every thread's stack after this long
GPU_SHARE = 0.3  # of the GPU's memory per engine (two engines live one after the other)


def demo_prompts(target: str, count: int, write_to: Path | None) -> list[list[int]]:
    from transformers import AutoTokenizer

    from eaglet.resources import resolve_input

    tokenizer = AutoTokenizer.from_pretrained(target)
    rows = [json.loads(line) for line in Path(resolve_input("demo")).read_text().splitlines() if line.strip()]
    rows = [row for row in rows if row.get("split") == "heldout"][:count]
    if write_to is not None:  # the same prompts for `eaglet eval --prompts FILE`
        write_to.write_text("".join(json.dumps(row) + "\n" for row in rows))
    rendered = [
        tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True)
        for row in rows
    ]
    return [list(ids["input_ids"] if hasattr(ids, "keys") else ids) for ids in rendered]


def generate(target: str, prompts: list[list[int]], max_new_tokens: int, speculative: dict | None) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        target,
        speculative_config=speculative,
        gpu_memory_utilization=GPU_SHARE,
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
    )
    load_s = time.perf_counter() - started
    sampling = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=False)
    inputs = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    llm.generate(inputs[:1], sampling, use_tqdm=False)  # warm-up
    started = time.perf_counter()
    one_by_one = [llm.generate([item], sampling, use_tqdm=False)[0] for item in inputs]
    batch1_s = time.perf_counter() - started
    started = time.perf_counter()
    batched = llm.generate(inputs, sampling, use_tqdm=False)
    batched_s = time.perf_counter() - started
    tokens = [list(out.outputs[0].token_ids) for out in one_by_one]
    metrics = {
        m.name: getattr(m, "value", getattr(m, "values", None))
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode")
    }
    result = {
        "load_s": round(load_s, 1),
        "tokens": tokens,
        "batched_tokens": [list(out.outputs[0].token_ids) for out in batched],
        "batch1_tok_s": round(sum(map(len, tokens)) / batch1_s, 1),
        "batched_tok_s": round(sum(len(o.outputs[0].token_ids) for o in batched) / batched_s, 1),
        "spec_metrics": metrics,
    }
    del llm
    gc.collect()
    import torch

    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--export", required=True)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--write-prompts", type=Path, default=None, help="the chosen prompts as a .jsonl")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(HANG_DUMP_S, repeat=True, file=sys.stderr)
    prompts = demo_prompts(args.target, args.prompts, args.write_prompts)
    plain = generate(args.target, prompts, args.max_new_tokens, None)
    print(json.dumps({"plain": {k: v for k, v in plain.items() if "tokens" not in k}}), flush=True)
    spec = generate(
        args.target,
        prompts,
        args.max_new_tokens,
        {"method": "eagle3", "model": args.export, "num_speculative_tokens": args.k},
    )
    metrics = spec["spec_metrics"]
    drafts = metrics.get("vllm:spec_decode_num_drafts") or 0
    accepted = metrics.get("vllm:spec_decode_num_accepted_tokens") or 0
    record = {
        "vllm": __import__("vllm").__version__,
        "target": args.target,
        "export": args.export,
        "k": args.k,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "greedy_equal_batch1": plain["tokens"] == spec["tokens"],
        "greedy_equal_batched": plain["batched_tokens"] == spec["batched_tokens"],
        "prompts_differing": sum(a != b for a, b in zip(plain["tokens"], spec["tokens"])),
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "spec_metrics": metrics,
        "tok_s": {
            "batch1_without": plain["batch1_tok_s"],
            "batch1_with": spec["batch1_tok_s"],
            f"batch{len(prompts)}_without": plain["batched_tok_s"],
            f"batch{len(prompts)}_with": spec["batched_tok_s"],
        },
        "load_s": {"without": plain["load_s"], "with": spec["load_s"]},
        "enforce_eager": True,
    }
    print(json.dumps(record, indent=2), flush=True)
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
