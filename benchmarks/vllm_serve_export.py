"""An eaglet export served by vLLM itself: greedy outputs with and without the draft, vLLM's own acceptance
counters, tokens/s at batch 1 and at a batch of all prompts.

Usage (on the GPU machine, vLLM installed by scripts/device/vllm_install.sh):
  python benchmarks/vllm_serve_export.py --target DIR --export DIR [DIR ...] [--k 3] [--prompts 32]
      [--batch1-prompts 8] [--repeats 3] [--max-new-tokens 128] [--eager] [--out FILE.json] [--write-prompts FILE.jsonl]
The prompts are the shipped demo prompts' held-out split, rendered with the target's chat template (what `eaglet
eval --prompts demo` decodes), so vLLM's mean acceptance length compares with eval's chain τ at depth k.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import statistics
import sys
import time
from pathlib import Path

HANG_DUMP_S = 240  # a silent engine prints every thread's stack after this long
GPU_SHARE = 0.3  # of the GPU's memory per engine: three fit should freed engines outlast their runs


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


def timed(run, repeats: int) -> tuple[list, dict]:
    """``run()`` ``repeats`` times: the last outputs and tokens/s as the median and range of the runs."""
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        outputs = run()
        rates.append(sum(len(out.outputs[0].token_ids) for out in outputs) / (time.perf_counter() - started))
    return outputs, {
        "median": round(statistics.median(rates), 1),
        "min": round(min(rates), 1),
        "max": round(max(rates), 1),
    }


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters so far (cumulative over the engine's life)."""
    return {
        m.name: getattr(m, "value", getattr(m, "values", None))
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode")
    }


def acceptance_length(counters: dict) -> float | None:
    """Mean tokens per verification, the bonus token included: 1 + accepted / drafts."""
    drafts = counters.get("vllm:spec_decode_num_drafts") or 0
    return round(1 + counters.get("vllm:spec_decode_num_accepted_tokens", 0) / drafts, 3) if drafts else None


def generate(target: str, prompts: list[list[int]], settings: argparse.Namespace, speculative: dict | None) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        target,
        speculative_config=speculative,
        gpu_memory_utilization=GPU_SHARE,
        enforce_eager=settings.eager,
        disable_log_stats=False,
        seed=0,
    )
    load_s = time.perf_counter() - started
    sampling = SamplingParams(temperature=0.0, max_tokens=settings.max_new_tokens, ignore_eos=False)
    inputs = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    llm.generate(inputs[:1], sampling, use_tqdm=False)  # warm-up
    one_by_one, batch1 = timed(
        lambda: [llm.generate([item], sampling, use_tqdm=False)[0] for item in inputs[: settings.batch1_prompts]],
        settings.repeats,
    )
    before_batched = spec_counters(llm)
    batched, batch_all = timed(lambda: llm.generate(inputs, sampling, use_tqdm=False), settings.repeats)
    metrics = spec_counters(llm)
    # the batched runs alone: every prompt decoded the same number of times, as `eaglet eval` decodes each once
    metrics["batched_only"] = {
        name: value - before_batched.get(name, 0) for name, value in metrics.items() if isinstance(value, int)
    }
    result = {
        "load_s": round(load_s, 1),
        "tokens": [list(out.outputs[0].token_ids) for out in one_by_one],
        "batched_tokens": [list(out.outputs[0].token_ids) for out in batched],
        "batch1_tok_s": batch1,
        "batched_tok_s": batch_all,
        "spec_metrics": metrics,
    }
    return result  # the engine is freed with `llm`; GPU_SHARE lets three live at once should it outlast this


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--export", required=True, nargs="+", help="export directories, each served in turn")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32, help="held-out demo prompts, all decoded as one batch")
    parser.add_argument("--batch1-prompts", type=int, default=8, help="of them, decoded one at a time")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each; median and range reported")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--eager", action="store_true", help="enforce_eager: no torch.compile, no CUDA graphs")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--write-prompts", type=Path, default=None, help="the chosen prompts as a .jsonl")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(HANG_DUMP_S, repeat=True, file=sys.stderr)
    prompts = demo_prompts(args.target, args.prompts, args.write_prompts)
    plain = generate(args.target, prompts, args, None)
    print(json.dumps({"plain": {k: v for k, v in plain.items() if "tokens" not in k}}), flush=True)
    records = []
    for export in args.export:
        spec = generate(
            args.target, prompts, args, {"method": "eagle3", "model": export, "num_speculative_tokens": args.k}
        )
        metrics = spec["spec_metrics"]
        record = {
            "vllm": __import__("vllm").__version__,
            "target": args.target,
            "export": export,
            "k": args.k,
            "prompts": len(prompts),
            "batch1_prompts": args.batch1_prompts,
            "max_new_tokens": args.max_new_tokens,
            "greedy_equal_batch1": plain["tokens"] == spec["tokens"],
            "greedy_equal_batched": plain["batched_tokens"] == spec["batched_tokens"],
            "prompts_differing_batched": sum(a != b for a, b in zip(plain["batched_tokens"], spec["batched_tokens"])),
            "mean_acceptance_length": acceptance_length(metrics),
            "mean_acceptance_length_batched_only": acceptance_length(metrics["batched_only"]),
            "spec_metrics": metrics,
            "tok_s": {
                "batch1_without": plain["batch1_tok_s"],
                "batch1_with": spec["batch1_tok_s"],
                f"batch{len(prompts)}_without": plain["batched_tok_s"],
                f"batch{len(prompts)}_with": spec["batched_tok_s"],
            },
            "speedup_batch1": round(spec["batch1_tok_s"]["median"] / plain["batch1_tok_s"]["median"], 3),
            f"speedup_batch{len(prompts)}": round(
                spec["batched_tok_s"]["median"] / plain["batched_tok_s"]["median"], 3
            ),
            "repeats": args.repeats,
            "load_s": {"without": plain["load_s"], "with": spec["load_s"]},
            "enforce_eager": args.eager,
        }
        print(json.dumps(record, indent=2), flush=True)
        records.append(record)
    if args.out:
        args.out.write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main()
