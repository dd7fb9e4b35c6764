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
        if self.top_p >= 1.0:
            return torch.softmax(logits.float() / self.temperature, dim=-1)
        kept, order = self.sorted_nucleus(logits)
        probs = torch.zeros_like(kept).scatter(-1, order, kept)
        return probs / probs.sum(-1, keepdim=True)

    def sorted_nucleus(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [..., V] -> (the tempered probabilities in descending order, those outside the nucleus zeroed, not
        renormalised; the sort's order, [..., V] each). The sort runs on the logits' own dtype (bf16 keys halve a radix
        sort's passes; temperature and softmax keep the order)."""
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits.float() / self.temperature, dim=-1)
        keep = sorted_probs.cumsum(-1) - sorted_probs < self.top_p  # always keeps the top token
        return sorted_probs * keep, order

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        if self.greedy:
            return int(logits.argmax(-1))
        return int(torch.multinomial(self.probs(logits), 1, generator=generator))
