"""Lossless speculative acceptance: rejection sampling for a chain's draft token, recursive rejection sampling
for a tree node's candidates (token choice itself: ``model.sampling.Sampling``)."""

from __future__ import annotations

import torch


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
