"""Tree drafting (EAGLE-2's dynamic tree): the draft expands its best candidates level by level, the target verifies
the whole tree in one forward under a tree attention mask, and the accepted path is the longest one the target
agrees with.

With k = top-k, level 1 holds the root's k best children, and each further level expands the k best candidates
of the level before into k children each (k*k candidates), so every level is one draft step over k rows. The
``budget`` best candidates overall (cumulative log-probability; stable sorts keep ties in candidate order) become
the tree, ordered by depth. ``grow_tree`` builds it with fixed shapes on the device and is the one builder: the
dynamic engine (``tree_decode``) runs it with the draft's dynamic caches, the graphed engine (``StaticTreeDraft``,
``static_tree_decode``) inside each round's CUDA graph. Level L's nodes run at RoPE position root + L - 1 and see
their ancestors' entries, as in training and as SGLang drafts trees.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..model.draft import Eagle3Draft
from ..model.sampling import Sampling
from .common import DecodeResult, Tree, draft_rope, finish, sync
from .runners import DraftRunner, TargetRunner
from .sampling import walk_candidates
from .static import RoundGraph, Rounds, StaticDraft, StaticTarget, compile_round_part, decode_in_rounds

# step(level, tokens [k], input hiddens [k, H], own speculative slots [k], visible [k, all slots]) -> hidden, logits
LevelStep = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _each_row_k_times(x: torch.Tensor, k: int) -> torch.Tensor:
    """[n, ...] -> [n*k, ...], row i repeated k times (``repeat_interleave`` by a view: nothing a graph capture
    could need to ask the host about)."""
    return x[:, None].expand(x.shape[0], k, *x.shape[1:]).reshape(x.shape[0] * k, *x.shape[1:])


def grow_tree(
    root_token: torch.Tensor,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    used: torch.Tensor,
    depth: int,
    width: int,
    budget: int,
    step: LevelStep,
) -> tuple[torch.Tensor, ...]:
    """The tree from the draft's output at the root (root_token [1], hidden [1, H], logits [1, Vd]); ``step`` runs a
    level's k rows, writing their entries to speculative slots (level - 2) * k + row. -> tokens [N], depths [N],
    parents [N] (root: 0), ancestor mask [N, N]; N = budget + 1 (budget at most the candidate count)."""
    k, device = width, logits.device
    spec = (depth - 1) * k  # speculative slots: k rows per expanded level
    top = torch.log_softmax(logits[0].float(), -1).topk(k)
    tokens, scores = [used[top.indices]], [top.values]  # per level: [k], then [k*k]
    parents = [torch.full((k,), -1, dtype=torch.long, device=device)]  # global candidate index
    depths = [torch.ones(k, dtype=torch.long, device=device)]
    inputs = hidden.expand(k, -1)  # [k, H]: the hidden each level-1 candidate is expanded with
    ancestors = torch.zeros(k, spec, dtype=torch.bool, device=device)  # slots of each candidate's processed ancestors
    slot = torch.arange(spec, device=device)
    level_start = 0  # global index of the previous level's first candidate
    for level in range(2, depth + 1):
        order = torch.sort(scores[-1], descending=True, stable=True).indices[:k]  # the k best of the last level
        frontier = level_start + order  # [k] global indices
        own = (level - 2) * k + torch.arange(k, device=device)  # [k] slots these rows write
        visible = ancestors[order] | (slot[None, :] == own[:, None])  # [k, spec]: its ancestors and itself
        out_hidden, out_logits = step(level, torch.cat(tokens)[frontier], inputs[order], own, visible)
        best = torch.log_softmax(out_logits.float(), -1).topk(k, dim=-1)  # [k, k]
        level_start += scores[-1].shape[0]
        tokens.append(used[best.indices].flatten())
        scores.append((torch.cat(scores)[frontier][:, None] + best.values).flatten())
        parents.append(_each_row_k_times(frontier, k))
        depths.append(torch.full((k * k,), level, dtype=torch.long, device=device))
        inputs = _each_row_k_times(out_hidden, k)  # [k*k, H]: each child expands from its parent's output
        ancestors = _each_row_k_times(visible, k)
    tokens, scores, parents, depths = (torch.cat(x) for x in (tokens, scores, parents, depths))  # [C]
    candidates = len(tokens)
    budget = min(budget, candidates)
    chosen = torch.sort(scores, descending=True, stable=True).indices[:budget]  # best first, ties by index
    chosen = chosen[torch.sort(depths[chosen], stable=True).indices]  # the tree's order: by depth, then score
    position = torch.zeros(candidates, dtype=torch.long, device=device)
    position[chosen] = torch.arange(1, budget + 1, device=device)
    tree_parents = torch.cat(
        [
            torch.zeros(1, dtype=torch.long, device=device),
            torch.where(parents[chosen] >= 0, position[parents[chosen].clamp_min(0)], 0),
        ]
    )
    block = torch.eye(budget + 1, dtype=torch.bool, device=device)
    for _ in range(depth):  # each pass adds one more generation of ancestors
        block = block | block[tree_parents]
    return (
        torch.cat([root_token, tokens[chosen]]),
        torch.cat([depths.new_zeros(1), depths[chosen]]),
        tree_parents,
        block,
    )


def expand_tree(
    draft: DraftRunner, root_token: int, hidden: torch.Tensor, logits: torch.Tensor, topk: int, depth: int, budget: int
) -> Tree:
    """The tree on the draft's dynamic caches (``grow_tree``, one host read at the end)."""
    draft.clear_speculation()
    width = min(topk, logits.shape[-1])
    with torch.inference_mode():
        tokens, depths, parents, _ = grow_tree(
            torch.tensor([root_token], device=draft.device),
            hidden[None],
            logits[None],
            draft.used,
            depth,
            width,
            budget,
            draft.tree_level,
        )
    parents_host = parents.tolist()
    return Tree(tokens.tolist(), [-1] + parents_host[1:], depths.tolist())


def tree_decode(
    target: TargetRunner,
    draft: DraftRunner,
    prompt: list[int],
    max_new: int,
    depth: int,
    topk: int,
    budget: int,
    stop_ids: set[int],
    sampling: Sampling = Sampling(),
    generator: torch.Generator | None = None,
) -> DecodeResult:
    """Speculative decoding over the tree on dynamic caches, verified in one target forward with a tree attention
    mask; the accepted path's cache entries are kept, the rest dropped. Greedy: follow the target's argmax down
    the tree. Sampling: at each node walk its children with ``walk_candidates`` (lossless for the deterministic
    top-k children the tree holds)."""
    sync(target.device)
    started = time.perf_counter()
    target.reset()
    draft.reset()
    logits, aux = target.forward(prompt)
    out = [sampling.pick(logits[-1], generator)]
    hidden, draft_logits = draft.extend(prompt[1:] + [out[-1]], aux)
    accepted_counts: list[int] = []
    while not finish(out, stop_ids, max_new)[1]:
        tree = expand_tree(draft, out[-1], hidden, draft_logits, topk, depth, budget)
        base = target.length
        verify_logits, verify_aux = target.forward(tree.tokens, tree=tree)
        choices = verify_logits.argmax(-1).tolist() if sampling.greedy else None  # one host read per round
        path, node = [], 0
        while True:
            children = tree.children(node)
            if choices is not None:
                correction = choices[node]
                chosen = next((c for c in children if tree.tokens[c] == correction), None)
            else:
                index, correction = walk_candidates(
                    sampling.probs(verify_logits[node]), [tree.tokens[c] for c in children], generator
                )
                chosen = None if index is None else children[index]
            if chosen is None:
                break
            path.append(chosen)
            node = chosen
        new_tokens = [tree.tokens[i] for i in path] + [correction]
        accepted_counts.append(len(path))
        out.extend(new_tokens)
        kept = torch.cat([torch.arange(base), base + torch.tensor([0] + path)]).to(target.device)
        target.keep(kept)
        draft.crop(base)
        hidden, draft_logits = draft.extend(new_tokens, verify_aux[[0] + path])
    sync(target.device)
    return DecodeResult(finish(out, stop_ids, max_new)[0], accepted_counts, time.perf_counter() - started)


class StaticTreeDraft(StaticDraft):
    """The draft on a static cache whose round is: extend, then grow the whole tree (one graph on GPU)."""

    def __init__(
        self,
        draft: Eagle3Draft,
        max_len: int,
        depth: int,
        topk: int,
        budget: int,
        graphs: bool | None = None,
        compiled: bool = False,
    ):
        self.width = min(topk, draft.config.draft_vocab_size)  # k: children per node and nodes expanded per level
        super().__init__(draft, max_len, depth, spec_slots=(depth - 1) * self.width, graphs=graphs, compiled=compiled)
        self.budget = min(budget, self.width + (depth - 1) * self.width**2)

    def _round(self) -> tuple[torch.Tensor, ...]:
        """-> tree tokens [N], depths [N], parents [N] (root: 0), ancestor mask [N, N]; N = budget + 1."""
        hidden, logits, root_token, end = self._extend_round_rows()
        real = (self._slot < end)[: self.max_len]  # [max_len]

        def level_step(
            level: int, tokens: torch.Tensor, inputs: torch.Tensor, own: torch.Tensor, visible: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            rows = len(tokens)
            mask = torch.cat([real.expand(rows, -1), visible], dim=1)  # [k, slots]
            cos, sin = (t.expand(rows, -1) for t in draft_rope(self.draft, (end + level - 2).view(1)))  # root + L - 1
            return self.draft.step(tokens, inputs, cos, sin, self._attends(self.max_len + own, mask))

        return grow_tree(root_token, hidden, logits, self.used, self.depth, self.width, self.budget, level_step)


class TreeRounds(Rounds):
    """Draft a tree, verify it with tree attention, follow the target's argmax down it, move the accepted path's
    cache entries behind the root."""

    def __init__(self, target: StaticTarget, draft: StaticTreeDraft):
        super().__init__(target)
        self.draft = draft
        depth, device = draft.depth, target.device
        self._levels = torch.arange(1, depth + 1, device=device)  # [D]
        self._row = torch.arange(depth + 1, device=device)  # [D+1]
        self._root = torch.zeros(1, dtype=torch.long, device=device)
        # the greedy walk's ~60 small kernels (D passes down the tree) fused when the draft's part is compiled
        self._accept = compile_round_part(self._walk, draft.compiled)
        self.graph = RoundGraph(device, target.graphs, self._body, [self.target_length, *draft.round_state()])

    def _walk(
        self, tokens: torch.Tensor, depths: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Follow the target's argmax down the tree: (accepted count 0-d, nodes [D+1]: root then the path, 0 past
        its end; new tokens [D+1]: the path's, then the correction, padded with it)."""
        choices = logits.argmax(-1)  # [N]: the target's token after each node
        is_root = torch.arange(len(tokens), device=tokens.device) == 0
        accepted = is_root
        for _ in range(self.draft.depth):  # a node is accepted when its parent is and it is the parent's choice
            accepted = ((tokens == choices[parents]) & accepted[parents]) | is_root
        count = accepted.sum() - 1  # 0-d: siblings hold distinct tokens, so the accepted nodes form one path
        at_level = accepted[None, :] & (depths[None, :] == self._levels[:, None])  # [D, N]
        nodes = torch.cat([self._root, at_level.int().argmax(-1)])  # [D+1]
        correction = choices.index_select(0, nodes.index_select(0, count.view(1)))  # [1]
        new_tokens = torch.where(self._row < count, torch.cat([tokens[nodes[1:]], correction]), correction)  # [D+1]
        return count, nodes, new_tokens

    def _body(self) -> torch.Tensor:
        """-> [D+2]: accepted count a, then the path's tokens and the correction (padded with the correction)."""
        draft = self.draft
        tokens, depths, parents, block = draft.draft_round()  # [N], [N], [N], [N, N]; node 0 is the root
        draft.in_start.add_(draft.in_real_rows)
        start = self.target_length
        logits, aux = self.target.run_block(tokens, depths, block, start)  # [N, V], [N, layers, H]
        count, nodes, new_tokens = self._accept(tokens, depths, parents, logits)
        self.target.move_entries(start + nodes, start + self._row)  # root + path behind the prefix
        self.target_length.add_(count + 1)
        draft.in_tokens.copy_(new_tokens)
        draft.in_aux.copy_(aux.index_select(0, nodes))
        draft.in_real_rows.copy_(count + 1)
        return torch.cat([count.view(1), new_tokens])


def static_tree_decode(
    target: StaticTarget,
    draft: StaticTreeDraft,
    prompt: list[int],
    max_new: int,
    stop_ids: set[int],
    rounds: TreeRounds | None = None,
) -> DecodeResult:
    """Greedy tree speculative decoding (``tree_decode``'s tokens and acceptance), each round one graph
    and one host read."""
    rounds = rounds or TreeRounds(target, draft)
    return decode_in_rounds(target, draft, rounds, prompt, max_new, stop_ids, max(draft.budget + 1, draft.depth + 1))
