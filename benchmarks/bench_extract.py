"""Benchmark `eaglet extract` end to end against the bare forward pass and the naive method, in one process.

  bare   the base model's forward over the same length-bucketed batches, features discarded
  eaglet run_extract(): capture, encode, device->host, shards written + fsynced + hashed (async writers)
  naive  output_hidden_states=True and one torch.save per sample (what research scripts do)

Usage: python benchmarks/bench_extract.py --model embedded|8b [--conversations N] [--out FILE.json]
`8b` is an 8B-shaped Llama with random bf16 weights (hidden 4096, 32 layers, vocab 128256).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import LLAMA_8B_SHAPE, useful_forward_flops, write_conversations  # noqa: E402

H200_BF16_DENSE_FLOPS = 989.4e12


def llama_8b_dir(root: Path, tokenizer_dir: Path) -> Path:
    """A target directory with the 8B config and the embedded tokenizer (weights are made in memory)."""
    from transformers import LlamaConfig

    config = LlamaConfig(**LLAMA_8B_SHAPE)
    root.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(root)
    for file in tokenizer_dir.iterdir():
        if file.name.startswith("tokenizer") or file.name.endswith(".jinja") or file.name == "special_tokens_map.json":
            shutil.copy(file, root / file.name)
    return root


def forward_flops(model, lengths) -> float:
    """``useful_forward_flops`` of the model's non-embedding parameters (embeddings and LM head left out)."""
    params = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)
    return useful_forward_flops(params, model.config.num_hidden_layers, model.config.hidden_size, lengths)


def measure_host_copy(device: str, gib: int = 1) -> dict | None:
    """Pinning and device->pinned-host copy speed: what moving features off the device can cost."""
    import torch

    if device != "cuda":
        return None
    source = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    started = time.perf_counter()
    host = torch.empty(gib << 30, dtype=torch.uint8, pin_memory=True)
    pin_s = time.perf_counter() - started
    host.copy_(source, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(3):
        host.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    copy_s = (time.perf_counter() - started) / 3
    return {"pin_gib_per_s": round(gib / pin_s, 2), "d2h_gib_per_s": round(gib / copy_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["embedded", "8b"], default="embedded")
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--answer-words", type=int, nargs=2, default=[300, 1500])
    parser.add_argument("--batch-tokens", type=int, default=32768)
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument("--storage-dtype", choices=["bf16", "fp8", "fp8-aux"], default="bf16")
    parser.add_argument("--store-dir", type=Path, default=None, help="where the store goes (default: inside --workdir)")
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke run)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch
    from rich.console import Console

    from eaglet.config import ExtractConfig, PrepareConfig
    from eaglet.data.prepare import run_prepare
    from eaglet.extract.extractor import run_extract
    from eaglet.formats.layers import default_aux_layer_ids
    from eaglet.formats.prepared import load_prepared
    from eaglet.model.capture import FeatureCapture, base_model_of, batches_by_length, right_padded
    from eaglet.model.target import load_model, resolve_target

    quiet = Console(stderr=True, quiet=True)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="eaglet-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    embedded = resolve_target("embedded")
    data = write_conversations(work / "conversations.jsonl", args.conversations, tuple(args.answer_words))
    run_prepare(PrepareConfig(inputs=[str(data)], out=str(work / "prepared"), max_len=2048, overwrite=True), quiet)
    prepared = load_prepared(work / "prepared")
    lengths = prepared.lengths
    if args.model == "embedded":
        target_dir = embedded.path
        model = load_model(target_dir, args.device, "bfloat16" if args.device == "cuda" else "float32")
    else:
        target_dir = llama_8b_dir(work / "llama-8b", embedded.path)
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(target_dir), dtype=torch.bfloat16 if args.device == "cuda" else torch.float32
            ).eval()
    layers = default_aux_layer_ids(model.config.num_hidden_layers)
    batches = batches_by_length(lengths, args.batch_tokens)
    base = base_model_of(model)
    flops = forward_flops(model, lengths.tolist())
    tokens = int(lengths.sum())

    def padded(batch):  # eaglet's own bucket: [batch, longest], right-padded
        return torch.from_numpy(right_padded(lambda sample: prepared.sample(sample)[0], lengths, batch)).to(args.device)

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    # warm-up: kernels, allocator, CUDA context
    with torch.inference_mode():
        FeatureCapture(model, layers)(padded(batches[0]))
    sync()

    started = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            base(input_ids=padded(batch), use_cache=False)
    sync()
    bare_s = time.perf_counter() - started

    host_copy = measure_host_copy(args.device)

    store = args.store_dir or work / "store"
    shutil.rmtree(store, ignore_errors=True)
    result = run_extract(
        ExtractConfig(
            prepared=str(work / "prepared"),
            out=str(store),
            target=str(target_dir),
            batch_tokens=args.batch_tokens,
            reserve_gb=0,
            device=args.device,
            storage_dtype=args.storage_dtype,
        ),
        quiet,
        model=model,
    )
    ours_s = result.seconds
    store_bytes = result.manifest["totals"]["bytes"]
    shutil.rmtree(store, ignore_errors=True)

    naive_s = None
    if not args.skip_naive:
        naive_dir = work / "naive"
        naive_dir.mkdir(exist_ok=True)
        started = time.perf_counter()
        with torch.inference_mode():
            for batch in batches:
                output = base(input_ids=padded(batch), output_hidden_states=True, use_cache=False)
                for row, sample in enumerate(batch.tolist()):
                    length = int(lengths[sample])
                    record = {
                        "aux": torch.stack([output.hidden_states[i][row, :length] for i in layers], 1).cpu(),
                        "last": output.last_hidden_state[row, :length].cpu(),
                    }
                    torch.save(record, naive_dir / f"{sample}.pt")
        sync()
        naive_s = time.perf_counter() - started
        shutil.rmtree(naive_dir, ignore_errors=True)

    record = {
        "benchmark": f"extract_{args.model}",
        "storage_dtype": args.storage_dtype,
        "store_dir": str(store.parent),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "samples": len(prepared),
        "tokens": tokens,
        "mean_length": round(float(lengths.mean()), 1),
        "batch_tokens": args.batch_tokens,
        "aux_layer_ids": list(layers),
        "bare_forward": {
            "seconds": round(bare_s, 3),
            "tokens_per_s": round(tokens / bare_s),
            "mfu": round(flops / bare_s / H200_BF16_DENSE_FLOPS, 4),
        },
        "host_copy": host_copy,
        "eaglet_extract": {
            "seconds": round(ours_s, 3),
            "tokens_per_s": round(tokens / ours_s),
            "mfu": round(flops / ours_s / H200_BF16_DENSE_FLOPS, 4),
            "writer_stall_s": round(result.writer_stall_s, 3),
            "store_gb": round(store_bytes / 1e9, 2),
            "write_gb_per_s": round(store_bytes / 1e9 / ours_s, 2),
        },
        "naive": None if naive_s is None else {"seconds": round(naive_s, 3), "tokens_per_s": round(tokens / naive_s)},
        "ratio_extract_vs_bare": round(bare_s / ours_s, 3),
        "ratio_extract_vs_naive": None if naive_s is None else round(naive_s / ours_s, 3),
    }
    print(json.dumps(record, indent=2), flush=True)
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
