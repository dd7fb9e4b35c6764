"""Shared fixtures: tokenizers built from the template families, tiny random models, the embedded target."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

TEMPLATES = Path(__file__).parent / "templates"

# Special tokens each family's template emits; eot first.
FAMILY_SPECIALS = {
    "llama3": {
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "extra": ["<|start_header_id|>", "<|end_header_id|>", "<|end_of_text|>"],
    },
    "qwen3": {"bos": None, "eos": "<|im_end|>", "extra": ["<|im_start|>", "<|endoftext|>"]},
    "qwen3_tools": {"bos": None, "eos": "<|im_end|>", "extra": ["<|im_start|>", "<|endoftext|>"]},
    "gemma": {"bos": "<bos>", "eos": "<end_of_turn>", "extra": ["<start_of_turn>", "<eos>"]},
}
# Non-special added tokens (Qwen3's think markers are added but not special).
FAMILY_PLAIN_ADDED = {"qwen3": ["<think>", "</think>"], "qwen3_tools": ["<tool_call>", "</tool_call>"]}

LM_HEAD_SHARPEN = 40.0

CORPUS = [
    "Hello there! How can I help you today?",
    "The capital of France is Paris. It is known for the Eiffel Tower.",
    "def add(a, b):\n    return a + b\n",
    "Let me think step by step. First, 2 + 2 = 4. Then 4 * 3 = 12.",
    "You are a helpful assistant. Answer briefly and precisely.",
    "system user assistant model Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024",
] * 20


def build_tokenizer(family: str):
    """A small byte-level BPE tokenizer with the family's special tokens and real chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILY_SPECIALS[family]
    specials = [t for t in [spec["bos"], spec["eos"], *spec["extra"]] if t]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=spec["bos"],
        eos_token=spec["eos"],
        additional_special_tokens=spec["extra"],
    )
    if family in FAMILY_PLAIN_ADDED:
        tokenizer.add_tokens(FAMILY_PLAIN_ADDED[family])
    tokenizer.chat_template = (TEMPLATES / f"{family}.jinja").read_text()
    return tokenizer


def tiny_llama_dir(root: Path, tokenizer_family: str = "qwen3", layers: int = 8, head_dim: int = 16):
    """A random 8-layer Llama saved with a family tokenizer: an HF directory eaglet can use as a target."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(tokenizer_family)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=4 * head_dim,
        intermediate_size=8 * head_dim,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a sharper head: a random model's teacher is otherwise near-uniform
        model.lm_head.weight.mul_(LM_HEAD_SHARPEN)
        model.model.norm.weight.uniform_(0.5, 1.5)  # a trained model's final norm is not all ones
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


@pytest.fixture
def mounts(tmp_path):
    """Mount helpers (root only): ``mount("full")`` a tmpfs with few inodes (fills up), ``mount("full", size)`` one of
    ``size`` (``"1m"``), ``mount("ro")`` a read-only bind mount; unmounted after the test."""
    mounted: list[Path] = []

    def mount(kind: str, size: str = "64m") -> Path:
        point = tmp_path / f"mnt-{kind}"
        point.mkdir()
        args = (
            ["-t", "tmpfs", "-o", f"size={size},nr_inodes=24", "tmpfs"]
            if kind == "full"
            else ["-o", "bind,ro", str(point)]
        )
        if subprocess.run(["mount", *args, str(point)], capture_output=True).returncode != 0:
            pytest.skip("mounting needs root (CAP_SYS_ADMIN) here")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], capture_output=True)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="session")
def embedded_target():
    from eaglet.model.target import resolve_target

    return resolve_target("embedded")


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    """Run the real `eaglet` entry point in process; return (exit code, stdout, stderr)."""
    import sys

    from eaglet.cli import main

    argv = sys.argv
    sys.argv = ["eaglet", *[str(a) for a in args]]
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = argv
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def small_conversations(n: int, seed: int = 0) -> list[dict]:
    """Short random conversations over a small word list (fast to prepare, extract and train on)."""
    import random

    rng = random.Random(seed)
    words = "the cat sat on a mat while two dogs ran past and one bird sang".split()
    return [
        {
            "id": f"c{i}",
            "messages": [
                {"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(3, 12)))},
                {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(5, 60)))},
            ],
        }
        for i in range(n)
    ]


def extract_args(prepared, out, target, *extra):
    return [
        "extract",
        "--prepared",
        prepared,
        "--out",
        out,
        "--target",
        target,
        "--shard-mb",
        "0.05",
        "--batch-tokens",
        "256",
        "--reserve-gb",
        "0",
        *extra,
    ]


def installed_at(root: Path, distribution: str, version: str, module: str = "vllm") -> Path:
    """A distribution as pip lays it out in site-packages (the module's package and its dist-info), under ``root``:
    put ``root`` on sys.path to have it installed."""
    (root / module).mkdir(parents=True)
    (root / module / "__init__.py").write_text("")
    info = root / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(f"{module}\n")
    return root


def store_bytes(store: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(store.iterdir()) if not p.name.startswith(".")}


@pytest.fixture(scope="session")
def tiny_prepared(tmp_path_factory, tiny_target):
    from eaglet.config import PrepareConfig
    from eaglet.data.prepare import run_prepare

    root = tmp_path_factory.mktemp("prepared")
    data = write_jsonl(root / "d.jsonl", small_conversations(60))
    run_prepare(PrepareConfig(inputs=[str(data)], out=str(root / "prepared"), target=str(tiny_target)))
    return root / "prepared"


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory, tiny_prepared, tiny_target):
    """A store extracted by the real CLI in a subprocess (the reference for byte-identity tests)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("ref") / "store"
    proc = subprocess.run(
        [sys.executable, "-m", "eaglet.cli", *map(str, extract_args(tiny_prepared, out, tiny_target))],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory, tiny_store, tiny_target):
    """A draft trained for a few steps on the tiny store."""
    from eaglet.config import TrainConfig
    from eaglet.train import run_train

    out = tmp_path_factory.mktemp("draft") / "run"
    run_train(
        TrainConfig(
            out=str(out),
            store=str(tiny_store),
            target=str(tiny_target),
            max_steps=12,
            token_budget=128,
            lr=3e-3,
            log_every=4,
            eval_every=6,
            seed=1,
        )
    )
    return out
