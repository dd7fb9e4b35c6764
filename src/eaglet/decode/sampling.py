"""Token choice for target and draft, and lossless speculative acceptance (greedy and rejection sampling)."""

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


def accept_or_resample(
    p: torch.Tensor, q: torch.Tensor, token: int, generator: torch.Generator | None
) -> tuple[bool, int]:
    """Speculative sampling's acceptance test for a draft ``token`` drawn from ``q``, target ``p`` [V].

    Accept with probability min(1, p/q); otherwise draw from normalize(max(0, p - q)). The emitted
    token is then distributed exactly as ``p`` (Leviathan et al., Chen et al. 2023)."""
    ratio = float(p[token]) / max(float(q[token]), 1e-30)
    if float(torch.rand((), generator=generator)) < min(1.0, ratio):
        return True, token
    residual = (p - q).clamp_min(0)
    if float(residual.sum()) <= 0:
        residual = p
    return False, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


def walk_candidates(
    p: torch.Tensor, candidates: list[int], generator: torch.Generator | None
) -> tuple[int | None, int]:
    """Lossless choice among distinct, deterministically proposed tokens (a tree node's children), target ``p`` [V].

    Recursive rejection sampling with point-mass proposals: candidate ``x`` is accepted with probability
    p(x); if not, p loses x (p <- normalize(p with p(x) = 0)) and the next candidate is tried; when all
    fail the token is drawn from what is left. Returns (index of the accepted candidate or None, token);
    the token is distributed exactly as ``p`` (the scheme EAGLE uses for its top-k trees)."""
    p = p.clone()
    for index, token in enumerate(candidates):
        mass = float(p.sum())
        if mass <= 0:
            break
        if float(torch.rand((), generator=generator)) < float(p[token]) / mass:
            return index, token
        p[token] = 0
    if float(p.sum()) <= 0:  # every token with mass was a rejected candidate: cannot happen with exact arithmetic
        raise ValueError("no probability mass left after rejecting the candidates")
    return None, int(torch.multinomial(p / p.sum(), 1, generator=generator))
