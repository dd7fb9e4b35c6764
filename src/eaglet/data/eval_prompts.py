"""The prompts `eaglet eval` decodes: each prompt file's rows of the split, rendered in the target's chat template,
at most ``max_prompts`` a file spread over its categories, each inside the target's context. Read from the tokenizer
and config.json alone, so the preflight (and `eaglet run`, before its first stage) selects exactly what eval will."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EagletError
from ..model.target import context_length, load_tokenizer
from ..resources import resolve_input
from .readers import BadRow, describe_splits, read_conversations

# a prompt row without a split is held out: a prompt file written for evaluation (MT-Bench's) marks none
UNMARKED_SPLIT = "heldout"


@dataclass(frozen=True)
class EvalPrompt:
    id: str
    source: str  # the prompt file as the report names it (``_source_labels``: "demo", "mt-bench", a file name)
    category: str
    ids: list[int]  # the prompt rendered with the chat template, tokenized


def context_problem(config: Any, context: int | None, prompt_tokens: int) -> str | None:
    """Why a prompt of ``prompt_tokens`` cannot be decoded inside the target's ``context``, or None: the target
    would be run at positions it never saw (a τ and a lossless check of noise)."""
    from ..model.target import past_context

    tuned = getattr(config, "tune", False)  # eval times tree shapes; bench drafts chains of --depth
    depth = max([config.depth] + [shape[0] for shape in config.tune_trees] if tuned else [config.depth])
    return past_context(prompt_tokens, config.max_new_tokens, context, depth)


def select_prompts(
    config: Any, tokenizer: Any, context: int | None, each_file: bool = True, skip_too_long: bool = False
) -> list[EvalPrompt]:
    """The prompts of ``config.split`` from each prompt file, at most ``max_prompts`` per file, spread over its
    categories. ``each_file``: a file with none of the split is an error (a report would silently lack it). A
    prompt too long for the target's ``context`` is an error, or left out with ``skip_too_long``."""
    rows: list[EvalPrompt] = []
    labels = _source_labels(config.prompts)
    for source in config.prompts:
        chosen, where, other_splits = [], {}, Counter()
        for item in read_conversations([resolve_input(source)]):
            if isinstance(item, BadRow):
                raise EagletError(f"{item}; fix the prompt file")
            split = item.meta.get("split", UNMARKED_SPLIT)
            if config.split != "all" and split != config.split:
                other_splits[split] += 1
                continue
            if item.uses_tools:
                raise EagletError(f"{item.source}: the prompt calls tools; eval decodes plain prompts, drop the row")
            text = tokenizer.apply_chat_template(item.prompt_messages, tokenize=False, add_generation_prompt=True)
            ids = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
            if skip_too_long and context_problem(config, context, len(ids)):
                continue
            chosen.append(EvalPrompt(item.id, labels[source], str(item.meta.get("category", "all")), ids))
            where[item.id] = item.source
        if not chosen and each_file:
            raise EagletError(
                f"{source}: no prompts of the {config.split} split (it holds {describe_splits(other_splits) or 'none'}); "
                "pick another --split or drop the file"
            )
        selected = _spread(chosen, config.max_prompts) if config.max_prompts and chosen else chosen
        for row in selected:  # only the prompts decoded: --max-prompts may leave a long one out
            problem = context_problem(config, context, len(row.ids))
            if problem:
                raise EagletError(f"{where[row.id]}: {problem}; shorten the prompt, lower --max-new-tokens, or drop it")
        rows.extend(selected)
    if not rows:
        raise EagletError(f"{', '.join(config.prompts)}: no prompts selected (split={config.split})")
    return rows


def evaluated_prompts(config: Any, target_path: Path) -> list[EvalPrompt]:
    """The prompts ``config`` evaluates, from the target's tokenizer and config.json alone (the preflight's)."""
    tokenizer = load_tokenizer(target_path, config.trust_remote_code)
    return select_prompts(config, tokenizer, context_length(target_path))


def _source_labels(names: list[str]) -> dict[str, str]:
    """How the report names each prompt file: its file name, or the path where two share a name."""
    short = {name: Path(name).name for name in names}
    counts = Counter(short.values())
    return {name: label if counts[label] == 1 else name for name, label in short.items()}


def _spread(rows: list[EvalPrompt], count: int) -> list[EvalPrompt]:
    """The first ``count`` prompts taken round-robin over categories, so a subset still covers them all."""
    by_category: dict[str, list[EvalPrompt]] = {}
    for row in rows:
        by_category.setdefault(row.category, []).append(row)
    picked = []
    for rank in range(max(len(v) for v in by_category.values())):
        picked.extend(group[rank] for group in by_category.values() if rank < len(group))
    return picked[:count]
