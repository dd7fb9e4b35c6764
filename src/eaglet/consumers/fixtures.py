"""The engines' source excerpts shipped with eaglet (``resources/consumers/<engine>-<version>.json``, written by
``scripts/refresh_consumer_fixtures.py``), and the facts about a verifier a reader needs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

ENGINES = ("vllm", "sglang")


@dataclass(frozen=True)
class Fixture:
    engine: str
    version: str
    wheel: str
    wheel_sha256: str
    sources: dict[str, str]  # path in the wheel -> excerpt text

    @property
    def label(self) -> str:
        return f"{self.engine} {self.version}"


def _fixture_files() -> list[Any]:
    folder = resources.files("eaglet.resources") / "consumers"
    return sorted((f for f in folder.iterdir() if f.name.endswith(".json")), key=lambda f: f.name)


@cache
def fixtures(engine: str) -> tuple[Fixture, ...]:
    """Every shipped excerpt set of ``engine``, oldest version first."""
    found = []
    for file in _fixture_files():
        data = json.loads(file.read_text(encoding="utf-8"))
        if data["consumer"] == engine:
            found.append(
                Fixture(data["consumer"], data["version"], data["wheel"], data["wheel_sha256"], data["sources"])
            )
    return tuple(sorted(found, key=lambda f: _version_key(f.version)))


def covered_versions(engine: str) -> list[str]:
    return [f.version for f in fixtures(engine)]


def _version_key(version: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in version.replace("-", ".").split("."))


@dataclass(frozen=True)
class VerifierFacts:
    """What a reader needs to know of the target the draft serves with (None: not known)."""

    vocab_size: int | None
    num_layers: int | None
