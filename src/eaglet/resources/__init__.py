"""Files shipped with eaglet: the demo prompts."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

DEMO_PROMPTS_NAME = "demo"


def demo_prompts_path() -> Path:
    """The shipped demo prompts: 1,040 prompts over 8 categories, 16 per category held out."""
    return Path(str(files(__package__) / "demo_prompts.jsonl"))


def resolve_input(path: str) -> str:
    """``demo`` names the shipped demo prompts unless a file of that name exists here."""
    if path == DEMO_PROMPTS_NAME and not Path(path).exists():
        return str(demo_prompts_path())
    return path


def demo_config_path(scale: str) -> Path:
    """The built-in `eaglet demo` run config for ``cpu`` or ``gpu``."""
    return Path(str(files(__package__) / f"demo_{scale}.yaml"))
