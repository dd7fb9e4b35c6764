"""Files shipped with eaglet: the demo prompts, MT-Bench's questions (prompts written elsewhere), the demo configs."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

DEMO_PROMPTS_NAME = "demo"
# Shipped prompt files by the name a config or option gives them: eaglet's demo prompts (1,040 over 8 categories,
# 16 per category held out), and MT-Bench's 80 first turns (10 per category, all held out; MT_BENCH_NOTICE.txt),
# which nothing in eaglet trains or tunes on: a draft's τ on them is its τ on prompts written elsewhere.
SHIPPED_PROMPTS = {DEMO_PROMPTS_NAME: "demo_prompts.jsonl", "mt-bench": "mt_bench_prompts.jsonl"}


def shipped_prompts_path(name: str) -> Path:
    return Path(str(files(__package__) / SHIPPED_PROMPTS[name]))


def demo_prompts_path() -> Path:
    return shipped_prompts_path(DEMO_PROMPTS_NAME)


def resolve_input(path: str) -> str:
    """A shipped prompt file's name (``demo``, ``mt-bench``) means that file unless a file of that name exists here."""
    if path in SHIPPED_PROMPTS and not Path(path).exists():
        return str(shipped_prompts_path(path))
    return path


def demo_config_path(scale: str) -> Path:
    """The built-in `eaglet demo` run config for ``cpu`` or ``gpu``."""
    return Path(str(files(__package__) / f"demo_{scale}.yaml"))
