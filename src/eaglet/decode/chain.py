"""Chain drafting: the draft proposes D tokens one after another, the target verifies them in one forward.

Per round (batch 1), with the target's cache holding positions ``0..n-1`` and ``x_n`` the newest token:

1. the draft proposes ``d_1..d_D``: ``d_1`` from its output at position n-1 (token ``x_n``, the target's
   aux features at n-1), then each ``d_{j+1}`` from one more step fed ``d_j`` and its own last hidden
   state, one RoPE position further per step (as vLLM and SGLang run drafts) and attending to its cached
   positions plus this chain's earlier steps: exactly the training-time-test pattern the draft was trained with;
2. the target verifies ``[x_n, d_1..d_D]`` in one forward, which also yields the aux features of
   those positions (what serving engines feed the draft);
3. the longest agreeing prefix ``d_1..d_a`` is kept, plus one token from the target (the correction
   or the bonus); both caches drop everything after it, and the draft extends its cache with the
   new positions using the target's real features.

Greedy verification reproduces the target's own greedy decoding token for token; sampling uses rejection
sampling, so the output distribution is the target's. Two engines run it: ``speculative_decode`` on dynamic
caches (greedy and sampled), and ``static_chain_decode`` with each greedy round one CUDA graph (``static.py``).
``batched.py`` runs greedy chains for many prompts at once.
"""

from __future__ import annotations

import time

import torch

from ..model.draft import Eagle3Draft
from ..model.sampling import Sampling
from .common import DecodeResult, draft_rope, finish, sync
from .runners import DraftRunner, TargetRunner
from .sampling import accept_or_resample
from .static import RoundGraph, Rounds, StaticDraft, StaticTarget, decode_in_rounds


def _greedy_chain_round(
    target: TargetRunner, draft: DraftRunner, last: int, hidden: torch.Tensor, draft_logits: torch.Tensor, depth: int
) -> tuple[list[int], int, int, torch.Tensor]:
    """Draft d_1..d_D and verify them, keeping every token on the device until one host read at the end
    (a 135M target is launch-bound: each host sync would stall the queue). Returns (proposals,
    accepted count, the target's correction or bonus token, the verify pass's aux features)."""
    proposals = []  # each [1], target ids
    for step in range(depth):
        if step:
            hidden, draft_logits = draft.speculate(proposals[-1], hidden)
        proposals.append(draft.used[draft_logits.argmax(-1, keepdim=True)])
    drafted = torch.cat(proposals)  # [D]
    verify_logits, verify_aux = target.forward(torch.cat([torch.tensor([last], device=target.device), drafted]))
    choices = verify_logits.argmax(-1)  # [D+1]: the target's token after out[-1], d_1, ..., d_D
    accepted = (choices[:depth] == drafted).int().cumprod(0).sum()
    host = torch.cat([choices, accepted[None], drafted]).tolist()
    accepted = host[depth + 1]
    return host[depth + 2 :], accepted, host[accepted], verify_aux


def _sampled_chain_round(
    target: TargetRunner,
    draft: DraftRunner,
    last: int,
    hidden: torch.Tensor,
    draft_logits: torch.Tensor,
    depth: int,
    vocab: int,
    sampling: Sampling,
    generator: torch.Generator | None,
) -> tuple[list[int], int, int, torch.Tensor]:
    """The same round with rejection sampling: each draft token drawn from the draft's distribution,
    accepted with min(1, p/q), the first rejection resampled from the residual."""
    proposals, proposal_probs = [], []
    for step in range(depth):
        if step:
            hidden, draft_logits = draft.speculate(proposals[-1], hidden)
        full = draft.to_target_logits(draft_logits, vocab)
        proposals.append(sampling.pick(full, generator))
        proposal_probs.append(sampling.probs(full))
    verify_logits, verify_aux = target.forward([last] + proposals)  # [D+1, V], [D+1, 3, H]
    accepted, correction = 0, None
    for index, token in enumerate(proposals):
        ok, choice = accept_or_resample(sampling.probs(verify_logits[index]), proposal_probs[index], token, generator)
        if not ok:
            correction = choice
            break
        accepted += 1
    if correction is None:
        correction = sampling.pick(verify_logits[depth], generator)
    return proposals, accepted, correction, verify_aux


def speculative_decode(
    target: TargetRunner,
    draft: DraftRunner,
    prompt: list[int],
    max_new: int,
    depth: int,
    sampling: Sampling,
    stop_ids: set[int],
    generator: torch.Generator | None = None,
) -> DecodeResult:
    """Chain speculative decoding on dynamic caches (see the module docstring)."""
    sync(target.device)
    started = time.perf_counter()
    target.reset()
    draft.reset()
    vocab = (
        target.model.config.get_text_config().vocab_size
        if hasattr(target.model.config, "get_text_config")
        else target.model.config.vocab_size
    )
    logits, aux = target.forward(prompt)
    out = [sampling.pick(logits[-1], generator)]
    hidden, draft_logits = draft.extend(prompt[1:] + [out[-1]], aux)
    accepted_counts: list[int] = []
    while not finish(out, stop_ids, max_new)[1]:
        base = target.length  # position of out[-1]
        if sampling.greedy:
            proposals, accepted, correction, verify_aux = _greedy_chain_round(
                target, draft, out[-1], hidden, draft_logits, depth
            )
        else:
            proposals, accepted, correction, verify_aux = _sampled_chain_round(
                target, draft, out[-1], hidden, draft_logits, depth, vocab, sampling, generator
            )
        new_tokens = proposals[:accepted] + [correction]
        accepted_counts.append(accepted)
        out.extend(new_tokens)
        target.crop(base + accepted + 1)  # keep out[-1-len(new)] .. d_a; the correction is not in the cache yet
        draft.crop(base)
        hidden, draft_logits = draft.extend(new_tokens, verify_aux[: accepted + 1])
    sync(target.device)
    return DecodeResult(finish(out, stop_ids, max_new)[0], accepted_counts, time.perf_counter() - started)


class StaticChainDraft(StaticDraft):
    """The draft on a static cache whose round is: extend, then propose a chain of D tokens."""

    def __init__(
        self, draft: Eagle3Draft, max_len: int, depth: int, graphs: bool | None = None, compiled: bool = False
    ):
        super().__init__(draft, max_len, depth, spec_slots=depth, graphs=graphs, compiled=compiled)

    def _round(self) -> tuple[torch.Tensor, ...]:
        """Extend, then propose D tokens: (drafted [D] target ids,)."""
        hidden, logits, _, end = self._extend_round_rows()
        token = self.used[logits.argmax(-1)]  # [1]
        drafted = [token]
        real = self._slot < end
        for step in range(1, self.depth):
            cos, sin = draft_rope(self.draft, (end - 1 + step).view(1))  # step j: the last real position + j
            spec_slot = self.max_len + step - 1
            mask = (real | ((self._slot >= self.max_len) & (self._slot <= spec_slot)))[None]  # [1, slots]
            hidden, logits = self.draft.step(
                token, hidden, cos, sin, self._attends(self._slot[spec_slot : spec_slot + 1], mask)
            )
            token = self.used[logits.argmax(-1)]
            drafted.append(token)
        return (torch.cat(drafted),)

    def round(self, tokens: torch.Tensor, aux: torch.Tensor, real_rows: torch.Tensor) -> torch.Tensor:
        """As ``StaticDraft.round``: the proposals [D]."""
        return self._run_round(tokens, aux, real_rows)[0]


class ChainRounds(Rounds):
    """Draft a chain of D, verify [x, d_1..d_D], keep the agreeing prefix and the target's next token."""

    def __init__(self, target: StaticTarget, draft: StaticChainDraft):
        super().__init__(target)
        self.draft = draft
        depth, device = draft.depth, target.device
        self._row = torch.arange(depth + 1, device=device)  # [D+1]: row index, and the chain's RoPE offsets
        self._causal = torch.ones(depth + 1, depth + 1, dtype=torch.bool, device=device).tril()
        self.graph = RoundGraph(device, target.graphs, self._body, [self.target_length, *draft.round_state()])

    def _body(self) -> torch.Tensor:
        """-> [D+2]: accepted count a, then the new tokens d_1..d_a, correction (padded with the correction)."""
        draft, depth = self.draft, self.draft.depth
        last = draft.in_tokens.index_select(0, (draft.in_real_rows - 1).view(1))  # [1]: the newest real token
        drafted = draft.draft_round()[0]  # [D]
        draft.in_start.add_(draft.in_real_rows)
        logits, aux = self.target.run_block(torch.cat([last, drafted]), self._row, self._causal, self.target_length)
        choices = logits.argmax(-1)  # [D+1]
        accepted = (choices[:depth] == drafted).int().cumprod(0).sum()  # 0-d
        correction = choices.index_select(0, accepted.view(1))  # [1]
        new_tokens = torch.where(self._row < accepted, torch.cat([drafted, correction]), correction)  # [D+1]
        self.target_length.add_(accepted + 1)  # [x, d_1..d_a] stay; the correction is the next round's x
        draft.in_tokens.copy_(new_tokens)  # the draft's next rows: d_1..d_a, correction, with their verify features
        draft.in_aux.copy_(aux)
        draft.in_real_rows.copy_(accepted + 1)
        return torch.cat([accepted.view(1), new_tokens])


def static_chain_decode(
    target: StaticTarget,
    draft: StaticChainDraft,
    prompt: list[int],
    max_new: int,
    stop_ids: set[int],
    rounds: ChainRounds | None = None,
) -> DecodeResult:
    """Greedy chain speculative decoding (``speculative_decode``'s tokens and acceptance), each round
    one graph and one host read. Pass the same ``rounds`` (``ChainRounds(target, draft)``) for every prompt so
    its graph is captured once."""
    rounds = rounds or ChainRounds(target, draft)
    return decode_in_rounds(target, draft, rounds, prompt, max_new, stop_ids, draft.depth + 1)
