"""Token choice for target and draft: greedy, or temperature then nucleus (top-p)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] -> the distribution tokens are drawn from (temperature, then nucleus)."""
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            keep = sorted_probs.cumsum(-1) - sorted_probs < self.top_p  # always keeps the top token
            sorted_probs = sorted_probs * keep
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        if self.greedy:
            return int(logits.argmax(-1))
        return int(torch.multinomial(self.probs(logits), 1, generator=generator))
