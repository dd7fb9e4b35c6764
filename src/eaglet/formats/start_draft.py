"""The draft a training run starts from (``train --init-from``): read, and refused in one line where it cannot be
this run's draft, by one rule that preflight and the run both ask."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import EagletError
from .draft_config import StoredDraft, read_draft_config, require_fits_target, start_problems
from .target_record import require_same_target


def read_start_draft(
    path: str | Path,
    info: Any,
    layer_ids: tuple[int, ...],
    draft_vocab_size: int,
    draft_layers: int,
    version: str | None,
) -> StoredDraft:
    """The draft at ``path`` for a run on the target ``info`` describes (a ``TargetInfo``: identity, name, sizes)
    with these features, draft vocabulary size, depth and --eagle-version (None: the draft's own norms)."""
    where = f"--init-from {path}"
    stored = read_draft_config(path, info.num_layers)
    if stored.made_elsewhere:  # no target record: its sizes must be this target's
        require_fits_target(stored.config, info.name, info.vocab_size, info.hidden_size, where)
    else:
        require_same_target(
            info.identity,
            stored.config.target,
            where,
            "trained for",
            "start from a draft of this target",
            config_only=True,
        )
    problems = start_problems(stored.config, layer_ids, draft_vocab_size, draft_layers, version)
    if problems:
        raise EagletError(f"{where}: {problems[0]}")
    return stored
