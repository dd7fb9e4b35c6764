"""What the target's weights fingerprint costs (``eaglet.model.weight_files.weights_fingerprint``): every stage that
reads a target computes it in preflight, so it must stay in seconds for the largest targets.

    python benchmarks/bench_weights_fingerprint.py --out benchmarks/results/weights_fingerprint_cpu.json

Two targets: the embedded one (real bytes on disk, read with the page cache dropped first when this process may, then
again warm), and a Kimi-K2-shaped layout (61 layers, 384 experts, the published INT4 tensors' names and shapes over
64 shards) written as sparse files: their headers are real, their data holes, so the time is the headers and the
number of reads, and a cold disk adds its latency per read (the JSON says how many).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import struct
import tempfile
import time
from pathlib import Path

from eaglet.model.target import count_parameters, resolve_target
from eaglet.model.weight_files import parameter_count, read_headers, sampled_names, weight_files, weights_fingerprint

RUNS = 5
KIMI_LAYERS, KIMI_EXPERTS, KIMI_HIDDEN, KIMI_EXPERT_HIDDEN, KIMI_SHARDS = 61, 384, 7168, 2048, 64
INT4_GROUP = 32  # compressed-tensors' pack-quantized: 8 int4 in an int32, a bf16 scale per 32 weights


def drop_page_cache() -> bool:
    """Empty the page cache (root only), so the next read comes from the disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def kimi_tensors() -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of a Kimi-K2-shaped INT4 checkpoint (attention, a shared expert and 384 routed experts
    a layer; the first layer dense)."""
    tensors: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": ("BF16", [163840, KIMI_HIDDEN])}
    for layer in range(KIMI_LAYERS):
        prefix = f"model.layers.{layer}"
        for name, shape in {
            "self_attn.q_a_proj.weight": [1536, KIMI_HIDDEN],
            "self_attn.q_b_proj.weight": [64 * 192, 1536],
            "self_attn.kv_a_proj_with_mqa.weight": [576, KIMI_HIDDEN],
            "self_attn.kv_b_proj.weight": [64 * 256, 512],
            "self_attn.o_proj.weight": [KIMI_HIDDEN, 64 * 128],
            "input_layernorm.weight": [KIMI_HIDDEN],
            "post_attention_layernorm.weight": [KIMI_HIDDEN],
        }.items():
            tensors[f"{prefix}.{name}"] = ("BF16", shape)
        experts = [f"mlp.experts.{e}" for e in range(KIMI_EXPERTS)] + ["mlp.shared_experts"] if layer else ["mlp"]
        for expert in experts:
            for projection, (rows, cols) in {
                "gate_proj": (KIMI_EXPERT_HIDDEN, KIMI_HIDDEN),
                "up_proj": (KIMI_EXPERT_HIDDEN, KIMI_HIDDEN),
                "down_proj": (KIMI_HIDDEN, KIMI_EXPERT_HIDDEN),
            }.items():
                tensors[f"{prefix}.{expert}.{projection}.weight_packed"] = ("I32", [rows, cols // 8])
                tensors[f"{prefix}.{expert}.{projection}.weight_scale"] = ("BF16", [rows, cols // INT4_GROUP])
                tensors[f"{prefix}.{expert}.{projection}.weight_shape"] = ("I32", [2])
    tensors["model.norm.weight"] = ("BF16", [KIMI_HIDDEN])
    tensors["lm_head.weight"] = ("BF16", [163840, KIMI_HIDDEN])
    return tensors


ELEMENT_BYTES = {"BF16": 2, "I32": 4}


def write_sparse_checkpoint(directory: Path) -> int:
    """The Kimi-shaped tensors over ``KIMI_SHARDS`` files with an index; data left as holes. Returns the bytes."""
    tensors = kimi_tensors()
    names = sorted(tensors)
    per_shard = -(-len(names) // KIMI_SHARDS)
    weight_map, total = {}, 0
    for shard in range(KIMI_SHARDS):
        file = f"model-{shard + 1:05d}-of-{KIMI_SHARDS:05d}.safetensors"
        header, offset = {}, 0
        for name in names[shard * per_shard : (shard + 1) * per_shard]:
            dtype, shape = tensors[name]
            size = ELEMENT_BYTES[dtype] * math.prod(shape)
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[name] = file
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(directory / file, "wb") as handle:
            handle.write(struct.pack("<Q", len(encoded)) + encoded)
            handle.truncate(8 + len(encoded) + offset)
        total += 8 + len(encoded) + offset
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total


def both_from_one_read(path: Path) -> None:
    """What ``target_info`` does: the headers read once, the parameter count and the fingerprint from them."""
    entries = read_headers(path)
    parameter_count(entries)
    weights_fingerprint(path, entries)


def summary(times: list[float]) -> dict[str, float]:
    return {
        "median_s": round(statistics.median(times), 4),
        "min_s": round(min(times), 4),
        "max_s": round(max(times), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = {}

    embedded = Path(resolve_target("embedded").path)
    cold = []
    for _ in range(RUNS):
        if not drop_page_cache():
            break
        cold.append(timed(lambda: weights_fingerprint(embedded)))
    warm = [timed(lambda: weights_fingerprint(embedded)) for _ in range(RUNS)]
    files = weight_files(embedded)
    names = [name for header in read_headers(embedded) for name in header.tensors]
    results["embedded"] = {
        "bytes": sum(f.stat().st_size for f in files),
        "tensors": len(names),
        "tensors_sampled": len(sampled_names(names)),
        "parameters": count_parameters(embedded),
        "cold_page_cache": summary(cold) if cold else "not measured (the page cache cannot be dropped here)",
        "warm": summary(warm),
    }

    with tempfile.TemporaryDirectory(prefix="eaglet-kimi-shaped-") as tmp:
        directory = Path(tmp)
        apparent = write_sparse_checkpoint(directory)
        tensors = kimi_tensors()
        sampled = sampled_names(tensors)
        times = [timed(lambda: weights_fingerprint(directory)) for _ in range(RUNS)]
        count_times = [timed(lambda: count_parameters(directory)) for _ in range(RUNS)]
        both_times = [timed(lambda: both_from_one_read(directory)) for _ in range(RUNS)]
        results["kimi_k2_shaped_int4_sparse"] = {
            "apparent_bytes": apparent,
            "tensors": len(tensors),
            "shards": KIMI_SHARDS,
            "tensors_sampled": len(sampled),
            "reads": 2 * len(sampled),
            "fingerprint": summary(times),
            "count_parameters_for_comparison": summary(count_times),
            "count_and_fingerprint_from_one_header_read": summary(both_times),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
