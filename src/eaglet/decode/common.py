"""What every decoder shares: the result of decoding one prompt, stopping, timing, and the draft's helpers."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch

from ..model.draft import Eagle3Draft
from ..model.target import decoding_attention


class Verified(Protocol):
    accepted: list[int]  # draft tokens accepted per verification forward


def acceptance_length(results: Iterable[Verified]) -> float:
    """τ over one or more decodings: tokens per target forward (accepted draft tokens + the target's own token)."""
    accepted, forwards = 0, 0
    for result in results:
        accepted += sum(result.accepted)
        forwards += len(result.accepted)
    return (accepted + forwards) / max(1, forwards)


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens (prompt excluded)
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per verification forward
    seconds: float = 0.0

    @property
    def forwards(self) -> int:
        return len(self.accepted)

    @property
    def acceptance_length(self) -> float:
        return acceptance_length([self])


def finish(tokens: list[int], stop_ids: set[int], max_new: int) -> tuple[list[int], bool]:
    """(the output cut at its first stop token or at ``max_new``, whether decoding is done)."""
    for index, token in enumerate(tokens[:max_new]):
        if token in stop_ids:
            return tokens[: index + 1], True
    return tokens[:max_new], len(tokens) >= max_new


def sync(device: torch.device) -> None:
    """Wait for the device (timings start and end on an idle stream)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_step(method):
    """Run a decoding method under inference mode with the decode attention backends."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        with torch.inference_mode(), decoding_attention():
            return method(*args, **kwargs)

    return run


def draft_target_ids(draft: Eagle3Draft) -> torch.Tensor:
    """[Vd]: the target token id of each draft-vocabulary index."""
    return torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device) + draft.d2t


def draft_rope(draft: Eagle3Draft, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] for the draft at integer ``positions``, in the draft's dtype."""
    cos, sin = draft.rope(positions)
    dtype = draft.fc.weight.dtype
    return cos.to(dtype), sin.to(dtype)


@dataclass
class Tree:
    """Draft tokens as a tree: index 0 is the root (the newest real token), parents come before children."""

    tokens: list[int]
    parents: list[int]  # -1 for the root
    depths: list[int]  # 0 for the root

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: j is i or an ancestor of i (what node i may attend to inside the tree)."""
        size = len(self.tokens)
        mask = torch.eye(size, dtype=torch.bool)
        for node in range(1, size):
            mask[node] |= mask[self.parents[node]]
        return mask

    def children(self, node: int) -> list[int]:
        """Node indices whose parent is ``node``, best draft score first (the tree's order)."""
        return [index for index in range(node + 1, len(self.tokens)) if self.parents[index] == node]

    def child(self, node: int, token: int) -> int | None:
        for index in range(node + 1, len(self.tokens)):
            if self.parents[index] == node and self.tokens[index] == token:
                return index
        return None
