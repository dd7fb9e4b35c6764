"""vLLM's own memory count at engine start beside eaglet's (model/vllm_memory.py), per target, on this GPU.

Each target is started in a fresh process as eaglet's generation stages start it (``gpu_memory_utilization`` 0.85,
bf16, language-only for a wrapper) with ``VLLM_LOGGING_LEVEL=DEBUG``, so vLLM's worker logs what it counted
(weights, peak activation, non-torch memory, CUDA graphs) and the KV cache it kept; eaglet's count of the same comes
from config.json alone. A config-only directory is loaded with ``load_format="dummy"`` (random weights, the same
memory). One JSON line per target on stdout, and the whole in --out.

    python benchmarks/vllm_memory.py --out vllm_memory.json TARGET_DIR [TARGET_DIR ...]
    python benchmarks/vllm_memory.py --llama-8b DIR   (writes the 8B shape's config.json there first)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
MEMORY_SHARE = 0.85  # eaglet's default gpu_memory_utilization (config.DEFAULT_VLLM_MEMORY_SHARE)
START = """
import sys
from vllm import LLM
path, multimodal, dummy = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
LLM(model=path, skip_tokenizer_init=not multimodal, language_model_only=multimodal, dtype="bfloat16",
    gpu_memory_utilization=%(share)s, load_format="dummy" if dummy else "auto", seed=0)
print("ENGINE_STARTED")
""" % {"share": MEMORY_SHARE}
ACTUAL = re.compile(
    r"Actual usage is ([\d.]+) GiB for weight, ([\d.]+) GiB for peak activation, ([\d.]+) GiB for non-torch "
    r"memory, and ([\d.]+) GiB for CUDAGraph memory"
)
KV = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")


def write_llama_8b(root: Path) -> Path:
    from synthetic import LLAMA_8B_SHAPE

    root.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16"}
    (root / "config.json").write_text(json.dumps(config | LLAMA_8B_SHAPE, indent=2))
    return root


def measured(target: Path) -> dict:
    from eaglet.model.target import raw_config
    from eaglet.model.vllm_engine import is_multimodal_wrapper
    from eaglet.model.weight_files import weight_files

    multimodal = is_multimodal_wrapper(raw_config(target))
    dummy = not weight_files(target)
    env = os.environ | {"VLLM_LOGGING_LEVEL": "DEBUG"}
    run = subprocess.run(
        [sys.executable, "-c", START, str(target), str(int(multimodal)), str(int(dummy))],
        capture_output=True,
        text=True,
        env=env,
    )
    log = run.stdout + run.stderr
    actual, kv, tokens = ACTUAL.search(log), KV.search(log), KV_TOKENS.search(log)
    if "ENGINE_STARTED" not in log or not (actual and kv):
        tail = "\n".join(log.splitlines()[-30:])
        raise SystemExit(f"{target}: vLLM did not start or did not log its memory:\n{tail}")
    weight, activation, non_torch, graphs = (float(x) for x in actual.groups())
    return {
        "weights_gib": weight,
        "activations_gib": activation,
        "runtime_gib": non_torch + graphs,  # eaglet counts these two as one term
        "non_torch_gib": non_torch,
        "cuda_graphs_gib": graphs,
        "kv_cache_gib": float(kv.group(1)),
        "kv_tokens": int(tokens.group(1).replace(",", "")) if tokens else None,
        "load_format": "dummy" if dummy else "auto",
    }


def predicted(target: Path) -> dict:
    import torch

    from eaglet.fsio import GIB
    from eaglet.model.sizing import Machine, weights_of
    from eaglet.model.target import raw_config, read_config
    from eaglet.model.vllm_memory import VllmAsk, vllm_layout

    properties = torch.cuda.get_device_properties(0)
    machine = Machine(1, int(properties.total_memory), properties.name)
    chosen = vllm_layout(
        raw_config(target), weights_of(read_config(target)), machine, VllmAsk(gpu_memory_utilization=MEMORY_SHARE)
    )
    return {
        "weights_gib": chosen.weights_per_gpu / GIB,
        "activations_gib": chosen.activations_per_gpu / GIB,
        "runtime_gib": chosen.runtime_per_gpu / GIB,
        "kv_cache_gib": chosen.kv_cache_per_gpu / GIB,
        "kv_tokens": chosen.kv_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", type=Path)
    parser.add_argument("--llama-8b", type=Path, help="write the 8B shape's config.json in this folder and measure it")
    parser.add_argument("--out", type=Path, default=Path("vllm_memory.json"))
    args = parser.parse_args()
    import torch
    import vllm

    targets = list(args.targets) + ([write_llama_8b(args.llama_8b)] if args.llama_8b else [])
    rows = []
    for target in targets:
        vllm_counts, eaglet_counts = measured(target), predicted(target)
        non_kv = {
            side: counts["weights_gib"] + counts["activations_gib"] + counts["runtime_gib"]
            for side, counts in (("vllm", vllm_counts), ("eaglet", eaglet_counts))
        }
        row = {
            "target": str(target),
            "gpu": torch.cuda.get_device_name(0),
            "vllm_version": vllm.__version__,
            "gpu_memory_utilization": MEMORY_SHARE,
            "vllm": vllm_counts,
            "eaglet": eaglet_counts,
            "non_kv_gib": non_kv,
            "non_kv_ratio": non_kv["eaglet"] / non_kv["vllm"],
            "kv_cache_ratio": eaglet_counts["kv_cache_gib"] / vllm_counts["kv_cache_gib"],
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
