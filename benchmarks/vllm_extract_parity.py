"""`eaglet extract --backend vllm` beside `--backend hf` and beside vLLM's own prefill, on one GPU (or on the CPU with
vLLM's CPU build: `bash scripts/dev.sh vllm-cpu` makes its venv).

Subcommands (each a fresh process, so one engine holds the GPU at a time):
  make-8b DIR --tokenizer DIR     a random Llama of the 8B shape (bf16, safetensors) with that tokenizer
  make-moe DIR --tokenizer DIR    a small random DeepseekV3 (Kimi-K2's architecture: MLA at its real ranks, shared
                                  + routed experts, a dense first layer)
  make-int4 DIR --tokenizer DIR   a small random Llama saved as a compressed-tensors INT4 checkpoint (packed
                                  symmetric groups of 128: Kimi-K2's weight format, at widths vLLM's Marlin takes)
  extract [--repeats N] [--sizes N,M] [--profile DIR] --backend hf|vllm ...
                                  `eaglet extract` N times in one process, the target loaded once; prints the
                                  median tok/s and every run's (load excluded)
  prefill --target DIR --prepared DIR [--repeats N] [--sizes N,M] [--route] [--profile DIR]
                                  vLLM alone, no connector, max_tokens=1 over the same samples: the ceiling;
                                  --route: the vllm backend's engine with requests that save nothing
  bare --target DIR --prepared DIR [--repeats N] [--sizes N,M]
                                  plain transformers' forward over the same samples (length buckets of
                                  --batch-tokens, padded, features discarded): issue 32's "today's bare forward"
  --sizes N,M (extract, prefill, bare): the first N samples, then the first M, ... through one engine (one start, one
                                  result line per size), in place of --max-samples
  --profile DIR (vllm): vLLM's torch profiler records its worker during one more run after the timed ones, traces in
                                  DIR; `python benchmarks/vllm_profile_summary.py DIR` says where the time went
  compare STORE_A STORE_B         per-token cosine of every aux layer and of `last`, sample by sample
  answers A.jsonl B.jsonl         two regenerate outputs of the same prompts: tok/s each, answers identical
Each prints one JSON object on stdout (the device call collects them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from quantized import quantized_target  # noqa: E402
from synthetic import LLAMA_8B_SHAPE, useful_forward_flops  # noqa: E402

INIT_STD = 0.02
SMALL_DEEPSEEK_V3 = dict(  # MLA at DeepSeek-V3's / Kimi-K2's ranks (what vLLM's MLA kernels expect), few experts
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    kv_lora_rank=512,
    q_lora_rank=128,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_group=2,
    topk_group=1,
    topk_method="noaux_tc",  # DeepSeek-V3's and Kimi-K2's config.json say so; vLLM builds the router's bias from it
    max_position_embeddings=4096,
    rope_scaling=None,
)


def make_8b(out: Path, tokenizer: Path) -> dict:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    started = time.perf_counter()
    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA_8B_SHAPE, initializer_range=INIT_STD, torch_dtype="bfloat16")
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out)
    return {"made": str(out), "seconds": round(time.perf_counter() - started, 1)}


def make_moe(out: Path, tokenizer: Path) -> dict:
    import torch
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    vocab = AutoTokenizer.from_pretrained(tokenizer)
    torch.manual_seed(0)
    config = DeepseekV3Config(
        **SMALL_DEEPSEEK_V3, vocab_size=len(vocab), eos_token_id=vocab.eos_token_id, torch_dtype="bfloat16"
    )
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    vocab.save_pretrained(out)
    return {"made": str(out), "parameters": sum(p.numel() for p in model.parameters())}


SMALL_INT4_LLAMA = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
)
INT4_GROUP = 128  # Kimi-K2's group size


def make_int4(out: Path, tokenizer: Path) -> dict:
    import tempfile

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    vocab = AutoTokenizer.from_pretrained(tokenizer)
    torch.manual_seed(0)
    config = LlamaConfig(
        **SMALL_INT4_LLAMA, vocab_size=len(vocab), eos_token_id=vocab.eos_token_id, initializer_range=INIT_STD
    )
    with tempfile.TemporaryDirectory() as dense:
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(dense)
        vocab.save_pretrained(dense)
        quantized_target(Path(dense), out, "int4", group_size=INT4_GROUP)
    files = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return {"made": str(out), "checkpoint_mb": round(files / 2**20, 1)}


def extract_config(values: dict):
    """An `eaglet extract` config from option values (``--max-samples`` or ``max_samples`` keys)."""
    from eaglet.config import ExtractConfig, build_config

    return build_config(
        ExtractConfig, "extract", cli_values={k.lstrip("-").replace("-", "_"): v for k, v in values.items()}
    )


def checkpoint_forward_flops(target: str | Path, lengths) -> float | None:
    """``useful_forward_flops`` (bench_extract.py's MFU count) with the parameters counted from the checkpoint's
    safetensors headers; None where they do not count them (a GGUF, a quantized checkpoint's packed weights)."""
    import math

    from safetensors import safe_open

    target = Path(target)
    config = json.loads((target / "config.json").read_text()) if (target / "config.json").is_file() else {}
    text = config.get("text_config") or config
    files = sorted(target.glob("*.safetensors"))
    if not files or text.get("quantization_config") or config.get("quantization_config"):
        return None
    params = 0
    for file in files:
        with safe_open(file, "pt") as handle:
            for name in handle.keys():
                if "embed" not in name and "lm_head" not in name:
                    params += math.prod(handle.get_slice(name).get_shape())
    return useful_forward_flops(params, int(text["num_hidden_layers"]), int(text["hidden_size"]), lengths)


def mfu(flops: float | None, tok_per_s: float, tokens: int) -> float | None:
    """The share of the GPU's dense bf16 peak that ``flops`` over ``tokens`` at ``tok_per_s`` is (None off a GPU)."""
    import torch

    from eaglet.model.sizing import Machine, peak_flops

    if flops is None or not torch.cuda.is_available():
        return None
    peak = peak_flops(Machine(gpus=1, gpu_memory=0, name=torch.cuda.get_device_name()))
    return round(flops * tok_per_s / tokens / peak, 4)


def compute_device() -> str:
    """Where both backends compute: the GPU, else the CPU (vLLM's CPU build)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def vllm_engine(config, profile_dir: str | None = None):
    """The vllm backend's engine for ``config``, opened as `eaglet extract` opens it (its checks included)."""
    from eaglet.extract.extractor import open_vllm_engine
    from eaglet.formats.layers import resolve_aux_layer_ids
    from eaglet.formats.prepared import load_prepared
    from eaglet.model.target import load_tokenizer, pick_dtype, resolve_target, target_info

    resolved = resolve_target(config.target, config.trust_remote_code)
    info = target_info(resolved, load_tokenizer(resolved.path, config.trust_remote_code))
    return open_vllm_engine(
        config,
        resolved.path,
        resolve_aux_layer_ids(config.layers, info.num_layers),
        info.num_layers,
        info.hidden_size,
        load_prepared(config.prepared, config.max_samples),
        Path(config.out),
        str(pick_dtype(config.dtype, compute_device())).replace("torch.", ""),
        profile_dir,
    )


def extract(argv: list[str], repeats: int, sizes: list[int | None], profile_dir: str | None = None) -> list[dict]:
    """`eaglet extract` ``repeats`` times into fresh stores (the last one kept at --out) for each of ``sizes`` (the
    first N samples; None: the options' own --max-samples), the target loaded once; ``profile_dir``: one more run
    (not timed) with vLLM's profiler recording its worker. One result per size, printed as it is known."""
    from eaglet.model.target import load_model, resolve_target

    options = dict(zip(argv[0::2], argv[1::2]))
    configs = [extract_config(options if size is None else {**options, "--max-samples": size}) for size in sizes]
    widest = max(configs, key=lambda config: config.max_samples or float("inf"))  # the engine sized for them all
    loaded: dict = {}
    if widest.backend == "vllm":
        loaded["engine"] = vllm_engine(widest, profile_dir)
    else:
        resolved = resolve_target(widest.target, widest.trust_remote_code)
        loaded["model"] = load_model(resolved.path, compute_device(), widest.dtype, widest.trust_remote_code, widest, 1)
    results = []
    for number, config in enumerate(configs, 1):
        results.append(timed_extract(config, loaded, repeats, profile_dir if number == len(configs) else None))
        print(json.dumps(results[-1]), flush=True)
    return results


def timed_extract(config, loaded: dict, repeats: int, profile_dir: str | None) -> dict:
    """One size's runs through the loaded target or engine."""
    import shutil

    from eaglet.extract.extractor import run_extract

    store = Path(config.out)
    runs = []
    for _ in range(repeats):
        shutil.rmtree(store, ignore_errors=True)
        result = run_extract(config, **loaded)
        runs.append({"seconds": result.seconds, "tok_per_s": result.tokens_computed / result.seconds,
                     "writer_stall_s": result.writer_stall_s, "writer_seconds": result.writer_seconds,
                     "waits": result.waits})  # fmt: skip
    if profile_dir is not None and "engine" in loaded:
        shutil.rmtree(store, ignore_errors=True)
        loaded["engine"].llm.start_profile()
        run_extract(config, **loaded)
        loaded["engine"].llm.stop_profile()
    from eaglet.formats.prepared import load_prepared

    rates = sorted(r["tok_per_s"] for r in runs)
    flops = checkpoint_forward_flops(config.target, load_prepared(config.prepared, config.max_samples).lengths)
    return {
        "backend": config.backend,
        "samples": config.max_samples,
        "store": str(store),
        "tokens": result.tokens_computed,
        "tok_per_s": round(statistics.median(rates)),  # an even count: the mean of the middle two
        "mfu": mfu(flops, statistics.median(rates), result.tokens_computed),
        "tok_per_s_runs": [round(r["tok_per_s"]) for r in runs],
        "writer_stall_s_runs": [round(r["writer_stall_s"], 3) for r in runs],
        # seconds the compute was idle, by cause (vllm: the drain, spool slots, between calls), per run
        "waits_runs": [{k: round(v, 3) for k, v in r["waits"].items()} for r in runs],
        # writer-thread seconds by phase (summed over shards and threads) of the median run (the upper middle one)
        "writer_seconds": {
            k: round(v, 3)
            for k, v in sorted(runs, key=lambda r: r["tok_per_s"])[len(runs) // 2]["writer_seconds"].items()
        },  # fmt: skip
    }


def prefill(
    target: str,
    prepared: str,
    sizes: list[int | None],
    batch_tokens: int,
    memory_share: float,
    repeats: int,
    route: bool,
    profile_dir: str | None = None,
) -> list[dict]:
    """vLLM's prefill over the first N samples for each N of ``sizes`` (None: all), ``max_tokens=1``, one engine for
    them all. ``route``: the vllm backend's own engine, opened as `eaglet extract` opens it (the
    ``extract_hidden_states`` method capturing eaglet's layers, eaglet's connector, no chunked prefill), its requests
    asking for nothing to be saved: what vLLM's route costs before eaglet's connector does any work."""
    import tempfile

    from vllm import LLM, SamplingParams

    from eaglet.formats.prepared import load_prepared
    from eaglet.model.target import pick_dtype
    from eaglet.model.vllm_engine import starting

    max_samples = None if None in sizes else max(sizes)
    data = load_prepared(prepared, max_samples)
    every = [data.sample(i)[0].tolist() for i in range(len(data))]
    longest = max(len(t) for t in every)
    if route:
        values = {"target": target, "prepared": prepared, "out": str(Path(tempfile.mkdtemp()) / "store"),
                  "backend": "vllm", "max_samples": max_samples, "batch_tokens": batch_tokens,
                  "gpu_memory_utilization": memory_share}  # fmt: skip
        llm = vllm_engine(extract_config({k: v for k, v in values.items() if v is not None}), profile_dir).llm
    else:
        with starting(target):  # vLLM's environment as eaglet's engine has it (spawned workers, the CPU's cache)
            llm = LLM(
                model=target,
                skip_tokenizer_init=True,
                dtype=str(pick_dtype("auto", compute_device())).replace("torch.", ""),
                max_model_len=longest + 1,
                max_num_batched_tokens=max(batch_tokens, longest + 1),
                enable_prefix_caching=False,
                gpu_memory_utilization=memory_share,
                seed=0,
                profiler_config=None
                if profile_dir is None
                else {
                    "profiler": "torch",
                    "torch_profiler_dir": str(Path(profile_dir).resolve()),
                    "torch_profiler_with_stack": False,
                },  # fmt: skip
            )
    sampling = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    llm.generate([{"prompt_token_ids": t} for t in every[:8]], sampling, use_tqdm=False)  # warm-up
    results = []
    for number, size in enumerate(sizes, 1):
        tokens = every[:size]
        total = sum(len(t) for t in tokens)
        rates = []
        for _ in range(repeats):
            started = time.perf_counter()
            llm.generate([{"prompt_token_ids": t} for t in tokens], sampling, use_tqdm=False)
            rates.append(total / (time.perf_counter() - started))
        if profile_dir is not None and number == len(sizes):
            llm.start_profile()
            llm.generate([{"prompt_token_ids": t} for t in tokens], sampling, use_tqdm=False)
            llm.stop_profile()
        median = statistics.median(rates)
        results.append({
            "backend": "vllm prefill, extract route, nothing saved" if route else "vllm prefill only",
            "samples": len(tokens),
            "tokens": total,
            "tok_per_s": round(median),
            "mfu": mfu(checkpoint_forward_flops(target, [len(t) for t in tokens]), median, total),
            "tok_per_s_runs": [round(r) for r in rates],
        })  # fmt: skip
        print(json.dumps(results[-1]), flush=True)
    return results


def bare(target: str, prepared: str, sizes: list[int | None], batch_tokens: int, repeats: int) -> list[dict]:
    """Plain transformers' forward over the first N samples for each N of ``sizes``: the target loaded once in the
    compute dtype, the samples in ``batches_by_length`` buckets (what the hf backend runs), padded, no cache, the
    outputs discarded — the bare forward issue 32 measures extraction against, on the same samples as ``prefill``."""
    import numpy as np
    import torch

    from eaglet.formats.prepared import load_prepared
    from eaglet.model.capture import base_model_of, batches_by_length, right_padded
    from eaglet.model.target import load_model, pick_dtype

    device = compute_device()
    dtype = str(pick_dtype("auto", device)).replace("torch.", "")
    base = base_model_of(load_model(Path(target), device, dtype))
    data = load_prepared(prepared, None if None in sizes else max(sizes))
    every = [data.sample(i)[0] for i in range(len(data))]
    lengths = np.array([len(t) for t in every])

    def run(batches: list[np.ndarray]) -> None:
        with torch.inference_mode():
            for batch in batches:
                ids = right_padded(every.__getitem__, lengths, batch)  # eaglet's own bucket: [batch, longest]
                base(input_ids=torch.from_numpy(ids).to(device), use_cache=False)
        if device == "cuda":
            torch.cuda.synchronize()

    results = []
    for size in sizes:
        batches = batches_by_length(lengths[:size], batch_tokens)
        run(batches[:2])  # warm-up: kernels and the allocator at the widest buckets
        total, rates = int(lengths[:size].sum()), []
        for _ in range(repeats):
            started = time.perf_counter()
            run(batches)
            rates.append(total / (time.perf_counter() - started))
        median = statistics.median(rates)
        results.append({
            "backend": "transformers bare forward",
            "samples": len(lengths[:size]),
            "tokens": total,
            "batch_tokens": batch_tokens,
            "tok_per_s": round(median),
            "mfu": mfu(checkpoint_forward_flops(target, lengths[:size].tolist()), median, total),
            "tok_per_s_runs": [round(r) for r in rates],
        })  # fmt: skip
        print(json.dumps(results[-1]), flush=True)
    return results


def compare(store_a: Path, store_b: Path, common: bool = False) -> dict:
    """Per-token cosine of every aux layer and of `last`, sample by sample; ``common``: over the samples both stores
    hold (a reference extracted with --max-samples beside a whole store), else the stores must hold the same."""
    import torch

    from eaglet.model.shards import store_samples

    def by_sample(store: Path) -> dict[int, tuple]:
        return {
            sample: (row["input_ids"], row["loss_mask"], row["aux"], row["last"])
            for sample, row in store_samples(store)
        }

    a, b = by_sample(store_a), by_sample(store_b)
    if common:
        a, b = ({k: v for k, v in rows.items() if k in a.keys() & b.keys()} for rows in (a, b))
    assert a and a.keys() == b.keys(), "the stores hold different samples"
    cosines: dict[str, list] = {"aux0": [], "aux1": [], "aux2": [], "last": []}
    first_token = []  # True where a token opens its sample (the attention sink: the largest activations)
    for sample in sorted(a):
        ids_a, mask_a, aux_a, last_a = a[sample]
        ids_b, mask_b, aux_b, last_b = b[sample]
        assert torch.equal(ids_a, ids_b) and torch.equal(mask_a, mask_b), f"sample {sample}: ids or mask differ"
        for k in range(3):
            cosines[f"aux{k}"].append(torch.nn.functional.cosine_similarity(aux_a[:, k], aux_b[:, k], dim=-1))
        cosines["last"].append(torch.nn.functional.cosine_similarity(last_a, last_b, dim=-1))
        first_token.append(torch.arange(len(ids_a)) == 0)
    opens = torch.cat(first_token)
    summary = {}
    for name, parts in cosines.items():
        values = torch.cat(parts).double()
        summary[name] = {
            "min": round(values.min().item(), 6),
            "p0.1": round(values.quantile(0.001).item(), 6),
            "p1": round(values.quantile(0.01).item(), 6),
            "mean": round(values.mean().item(), 6),
            "tokens_below_0.999": int((values < 0.999).sum()),
            "of_them_first_tokens": int(((values < 0.999) & opens).sum()),
        }
    return {
        "a": str(store_a),
        "b": str(store_b),
        "samples": len(a),
        "tokens": int(sum(len(v[0]) for v in a.values())),
        "cosine": summary,
    }


def answers(a: Path, b: Path) -> dict:
    """Two `eaglet regenerate` outputs of the same prompts: their rates and how many answers are the same text."""
    rows = [{json.loads(line)["id"]: json.loads(line) for line in path.read_text().splitlines()} for path in (a, b)]
    manifests = [json.loads(Path(f"{path}.manifest.json").read_text()) for path in (a, b)]
    assert rows[0].keys() == rows[1].keys(), "the files answer different prompts"
    same = sum(rows[0][k]["messages"][-1] == rows[1][k]["messages"][-1] for k in rows[0])
    return {
        "answers": len(rows[0]),
        "identical": same,
        "tok_per_s": {m["settings"]["backend"]: m["tokens_per_s"] for m in manifests},
        "seconds": {m["settings"]["backend"]: m["seconds_this_run"] for m in manifests},
        "new_tokens": {m["settings"]["backend"]: m["new_tokens_this_run"] for m in manifests},
    }


def sample_counts(text: str) -> list[int]:
    """``--sizes``: positive sample counts, comma-separated."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: sample counts separated by commas, e.g. 912,3648") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: each sample count must be at least 1")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    made = sub.add_parser("make-8b")
    made.add_argument("out", type=Path)
    made.add_argument("--tokenizer", type=Path, required=True)
    moe = sub.add_parser("make-moe")
    moe.add_argument("out", type=Path)
    moe.add_argument("--tokenizer", type=Path, required=True)
    int4 = sub.add_parser("make-int4")
    int4.add_argument("out", type=Path)
    int4.add_argument("--tokenizer", type=Path, required=True)
    ext = sub.add_parser("extract", help="the rest of the line: `eaglet extract` options")
    ext.add_argument("--repeats", type=int, default=1)
    ext.add_argument("--sizes", type=sample_counts, default=[None], help="first N samples, comma-separated")
    ext.add_argument("--profile", default=None, help="vllm: profile one more run, traces in this folder")
    pre = sub.add_parser("prefill")
    pre.add_argument("--target", required=True)
    pre.add_argument("--prepared", required=True)
    pre.add_argument("--max-samples", type=int, default=None)
    pre.add_argument("--sizes", type=sample_counts, default=None, help="first N samples, comma-separated")
    pre.add_argument("--batch-tokens", type=int, default=32768)
    pre.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    pre.add_argument("--repeats", type=int, default=1)
    pre.add_argument("--route", action="store_true", help="the vllm backend's engine, requests saving nothing")
    pre.add_argument("--profile", default=None, help="profile one more run, traces in this folder")
    bar = sub.add_parser("bare")
    bar.add_argument("--target", required=True)
    bar.add_argument("--prepared", required=True)
    bar.add_argument("--sizes", type=sample_counts, default=[None], help="first N samples, comma-separated")
    bar.add_argument("--batch-tokens", type=int, default=32768)
    bar.add_argument("--repeats", type=int, default=1)
    ans = sub.add_parser("answers")
    ans.add_argument("a", type=Path)
    ans.add_argument("b", type=Path)
    cmp = sub.add_parser("compare")
    cmp.add_argument("a", type=Path)
    cmp.add_argument("b", type=Path)
    cmp.add_argument("--common", action="store_true", help="only the samples both stores hold")
    args, rest = parser.parse_known_args()
    if rest and args.command != "extract":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "make-8b":
        result = make_8b(args.out, args.tokenizer)
    elif args.command == "make-moe":
        result = make_moe(args.out, args.tokenizer)
    elif args.command == "make-int4":
        result = make_int4(args.out, args.tokenizer)
    elif args.command == "extract":
        extract(rest, args.repeats, args.sizes, args.profile)  # printed size by size
        return
    elif args.command == "prefill":
        if args.sizes and args.max_samples:
            parser.error("--sizes replaces --max-samples: give one")
        prefill(
            args.target,
            args.prepared,
            args.sizes or [args.max_samples],
            args.batch_tokens,
            args.gpu_memory_utilization,
            args.repeats,
            args.route,
            args.profile,
        )
        return
    elif args.command == "bare":
        bare(args.target, args.prepared, args.sizes, args.batch_tokens, args.repeats)
        return
    elif args.command == "answers":
        result = answers(args.a, args.b)
    else:
        result = compare(args.a, args.b, args.common)
    print(json.dumps(result), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
