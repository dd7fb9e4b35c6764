"""`eaglet export`'s formats, one module each (config, tensor names, serve command, engines, readers), and the
registry every list of formats derives from. A new format is one module here, listed in ``FORMATS``, plus its
tests. The writer is ``eaglet.export.write``; these declarations are torch-free (the config and preflight read them)."""

from __future__ import annotations

from typing import Any

from ..errors import EagletError
from ..formats.foreign_draft import exported_format_name
from . import sglang, speculators, vllm
from .spec import ExportFormat

FORMATS: dict[str, ExportFormat] = {module.FORMAT.name: module.FORMAT for module in (vllm, sglang, speculators)}
FORMAT_NAMES = tuple(FORMATS)
ENGINES = tuple(sorted({engine for fmt in FORMATS.values() for engine in fmt.engines}))


def export_format(name: str, where: str = "export format") -> ExportFormat:
    """The format called ``name``, refused in one line naming the known ones."""
    if name not in FORMATS:
        raise EagletError(f"{where} {name!r}: not an export format; choose one of {', '.join(FORMAT_NAMES)}")
    return FORMATS[name]


def format_of_directory(config: dict[str, Any]) -> ExportFormat:
    """The format an export directory's config.json is in, as an engine recognises it: ``speculators_config`` only
    the speculators format has; the vLLM and SGLang directories are one."""
    return FORMATS[exported_format_name(config)]


def verifier_reference(config: dict[str, Any], override: str | None = None) -> tuple[str, str]:
    """How exported configs name the target: (name_or_path, how it was chosen). A hub id where one is known
    (portable); the local directory otherwise (works on this machine only)."""
    target = config.get("target", {})
    if override:
        return override, "given with --verifier"
    if target.get("hub_id"):
        return target["hub_id"], "the target's hub id"
    if target.get("path"):
        return target["path"], (
            "a local path: this export is not portable; re-export with --verifier ORG/NAME "
            "(the hub id) to serve it elsewhere"
        )
    return target.get("name") or "TARGET", "the target's name (no hub id or path recorded)"
