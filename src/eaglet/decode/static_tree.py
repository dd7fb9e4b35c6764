"""The EAGLE-2 tree drafted on the device with fixed shapes: the whole tree in one graph.

``DraftRunner.expand_tree`` builds the tree on the host, one host read per level; on an H200 that costs
more than the tree saves once the target is a CUDA graph (RESULTS.md: graphed trees ran at 0.66-0.68x).
Here the same tree is built with fixed shapes on the device: with k = top-k, level 1 holds the root's k best
children, and each further level expands the k best candidates of the level before into k children each
(k*k candidates), so every level is one draft step over k rows. The ``budget`` best candidates overall
(cumulative log-probability; stable sorts reproduce the host's tie order) become the tree, ordered by depth;
its tokens, RoPE depths and ancestor mask go straight into the target's verification, in the same graph
(``rounds.TreeRounds``: the greedy walk, the cache compaction and the next round's rows follow on the device).
"""

from __future__ import annotations

import torch

from ..draft import Eagle3Draft
from .engine import draft_rope
from .static_draft import StaticDraft


def _each_row_k_times(x: torch.Tensor, k: int) -> torch.Tensor:
    """[n, ...] -> [n*k, ...], row i repeated k times (``repeat_interleave`` by a view: nothing a graph capture
    could need to ask the host about)."""
    return x[:, None].expand(x.shape[0], k, *x.shape[1:]).reshape(x.shape[0] * k, *x.shape[1:])


class StaticTreeDraft(StaticDraft):
    """The draft on a static cache whose round is: extend, then draft a whole tree (one graph on GPU)."""

    def __init__(self, draft: Eagle3Draft, max_len: int, depth: int, topk: int, budget: int, graphs: bool | None = None,
                 compiled: bool = False):
        self.width = min(topk, draft.config.draft_vocab_size)  # k: children per node and nodes expanded per level
        expanded = (depth - 1) * self.width  # spec entries: k rows per expanded level
        super().__init__(draft, max_len, depth, graphs, spec_slots=expanded, compiled=compiled)
        self.candidates = self.width + (depth - 1) * self.width**2
        self.budget = min(budget, self.candidates)

    def _round(self) -> tuple[torch.Tensor, ...]:
        """-> tree tokens [N], depths [N], parents [N] (root: 0), ancestor mask [N, N]; N = budget + 1."""
        k, device = self.width, self.device
        hidden, logits, root_token, end = self._extend_round_rows()
        real = self._slot < end  # [slots]
        spec = self._slot.shape[0] - self.max_len
        top = torch.log_softmax(logits[0].float(), -1).topk(k)
        tokens, scores = [self.used[top.indices]], [top.values]  # per level: [k], then [k*k]
        parents = [torch.full((k,), -1, dtype=torch.long, device=device)]  # global candidate index
        depths = [torch.ones(k, dtype=torch.long, device=device)]
        inputs = hidden.expand(k, -1)  # [k, H]: the hidden each level-1 candidate is expanded with
        ancestors = torch.zeros(k, spec, dtype=torch.bool, device=device)  # spec slots of processed ancestors
        spec_index = torch.arange(spec, device=device)  # (no host-scalar writes inside a captured graph)
        level_start = 0  # global index of the previous level's first candidate
        for level in range(2, self.depth + 1):
            order = torch.sort(scores[-1], descending=True, stable=True).indices[:k]  # the k best of the last level
            frontier = level_start + order  # [k] global indices
            own = (level - 2) * k + torch.arange(k, device=device)  # [k] spec slots these rows write
            visible = ancestors[order] | (spec_index[None, :] == own[:, None])  # [k, spec]: ancestors + itself
            mask = torch.cat([real.expand(k, -1)[:, : self.max_len], visible], dim=1)  # [k, slots]
            cos, sin = (t.expand(k, -1) for t in draft_rope(self.draft, (end + level - 2).view(1)))  # root + L - 1
            out_hidden, out_logits = self.draft.step(torch.cat(tokens)[frontier], inputs[order], cos, sin,
                                                     self._attends(self.max_len + own, mask))
            best = torch.log_softmax(out_logits.float(), -1).topk(k, dim=-1)  # [k, k]
            level_start += scores[-1].shape[0]
            tokens.append(self.used[best.indices].flatten())
            scores.append((torch.cat(scores)[frontier][:, None] + best.values).flatten())
            parents.append(_each_row_k_times(frontier, k))
            depths.append(torch.full((k * k,), level, dtype=torch.long, device=device))
            inputs = _each_row_k_times(out_hidden, k)  # [k*k, H]: each child expands from its parent's output
            ancestors = _each_row_k_times(visible, k)
        tokens, scores, parents, depths = (torch.cat(x) for x in (tokens, scores, parents, depths))  # [C]
        chosen = torch.sort(scores, descending=True, stable=True).indices[: self.budget]  # best first, ties by index
        chosen = chosen[torch.sort(depths[chosen], stable=True).indices]  # the tree's order: by depth, then score
        position = torch.zeros(self.candidates, dtype=torch.long, device=device)
        position[chosen] = torch.arange(1, self.budget + 1, device=device)
        tree_parents = torch.cat([torch.zeros(1, dtype=torch.long, device=device),
                                  torch.where(parents[chosen] >= 0, position[parents[chosen].clamp_min(0)], 0)])
        size = self.budget + 1
        block = torch.eye(size, dtype=torch.bool, device=device)
        for _ in range(self.depth):  # each pass adds one more generation of ancestors
            block = block | block[tree_parents]
        return (torch.cat([root_token, tokens[chosen]]), torch.cat([depths.new_zeros(1), depths[chosen]]),
                tree_parents, block)

    def round(self, tokens: torch.Tensor, aux: torch.Tensor, real_rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """As ``StaticDraft.round``, returning the tree: tokens [N], depths [N], parents [N], ancestor mask [N, N]."""
        return self._run_round(tokens, aux, real_rows)

