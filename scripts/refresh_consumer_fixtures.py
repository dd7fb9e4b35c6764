"""Extract the parts of the serving engines' released sources that decide how they read an EAGLE-3 draft.

`eaglet export --check` and the consumer tests read these excerpts (where and how each engine loads the
draft's tensors and config fields) instead of importing the engines, which do not install on a CPU machine.
Each excerpt is cut from the released wheel (downloaded with `pip download --no-deps`) and stored with the
wheel's name and sha256 in src/eaglet/resources/consumers/<engine>-<version>.json.

    python scripts/refresh_consumer_fixtures.py --vllm 0.33.0 --sglang 0.5.23

A new engine release: run this with its version, then `bash scripts/dev.sh test` (the consumer tests read every
fixture) and `eaglet export --check` on an export; a loader change that eaglet's reader does not follow fails there.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "src" / "eaglet" / "resources" / "consumers"

# file in the wheel -> the top-level names kept ("*" = the whole file; "Class.method" = that method alone)
EXCERPTS = {
    "vllm": {
        "vllm/model_executor/models/llama_eagle3.py": ["*"],
        "vllm/model_executor/models/llama.py": ["LlamaMLP", "LlamaAttention", "LlamaDecoderLayer", "LlamaModel"],
        "vllm/model_executor/models/registry.py": ["_SPECULATIVE_DECODING_MODELS"],
        "vllm/transformers_utils/config.py": ["HFConfigParser.parse"],
        "vllm/model_executor/models/utils.py": ["WeightsMapper"],
        "vllm/v1/worker/gpu_model_runner.py": ["GPUModelRunner._get_eagle3_aux_layers_from_config"],
        "vllm/transformers_utils/configs/speculators/algos.py": ["update_eagle3"],
        "vllm/transformers_utils/configs/speculators/base.py": ["SpeculatorsConfig"],
    },
    "sglang": {
        "sglang/srt/models/llama_eagle3.py": ["*"],
        "sglang/srt/models/llama.py": [
            "LlamaMLP",
            "LlamaAttention",
            "LlamaDecoderLayer",
            "LlamaModel",
            "LlamaForCausalLM.set_eagle3_layers_to_capture",
        ],
        "sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py": [
            "_resolve_eagle_aux_hidden_state"
        ],
    },
}


def excerpt(source: str, names: list[str]) -> str:
    """The module's imports plus the named top-level definitions and assignments (a method inside a stub of
    its class)."""
    if names == ["*"]:
        return source
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    kept = [
        "".join(lines[node.lineno - 1 : node.end_lineno])
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
    ]
    by_name = {node.name: node for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    by_name |= {
        target.id: node
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    }
    for name in names:
        owner, _, method = name.partition(".")
        if owner not in by_name:
            raise SystemExit(f"{name}: not found at the top level of the module")
        node = by_name[owner]
        if not method:
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            kept.append("".join(lines[start - 1 : node.end_lineno]))
            continue
        inner = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == method), None)
        if inner is None:
            raise SystemExit(f"{name}: no such method")
        start = min([inner.lineno] + [d.lineno for d in inner.decorator_list])
        kept.append(f"class {owner}:  # excerpt: one method\n" + "".join(lines[start - 1 : inner.end_lineno]))
    return "\n\n".join(kept)


def refresh(engine: str, version: str) -> Path:
    with tempfile.TemporaryDirectory(prefix="eaglet-consumer-") as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, f"{engine}=={version}"], check=True
        )
        wheel = next(Path(tmp).glob("*.whl"))
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        with zipfile.ZipFile(wheel) as archive:
            sources = {
                path: excerpt(archive.read(path).decode("utf-8"), names) for path, names in EXCERPTS[engine].items()
            }
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"{engine}-{version}.json"
    out.write_text(
        json.dumps(
            {"consumer": engine, "version": version, "wheel": wheel.name, "wheel_sha256": digest, "sources": sources},
            indent=1,
        )
        + "\n",
        encoding="utf-8",
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for engine in EXCERPTS:
        parser.add_argument(f"--{engine}", metavar="VERSION", help=f"the {engine} release to read")
    args = parser.parse_args()
    wanted = {engine: getattr(args, engine) for engine in EXCERPTS if getattr(args, engine)}
    if not wanted:
        parser.error("name at least one engine version, e.g. --vllm 0.33.0")
    for engine, version in wanted.items():
        print(f"{engine} {version}: {refresh(engine, version)}")


if __name__ == "__main__":
    main()
