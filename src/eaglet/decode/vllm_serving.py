"""`eaglet eval --backend vllm`: the exported draft measured inside vLLM, the engine that serves it.

vLLM holds the target as it would serve it (its own kernels, quantized weights, tensor parallelism: targets only
vLLM can hold get a τ too) and runs the draft with ``speculative_config`` (method ``eagle3``, ``--depth`` tokens a
round). What is measured, on the same prompts as the transformers backend selects:

- τ from vLLM's own counters, as vLLM reports it: 1 + Σ accepted / Σ drafts, pooled over requests; acceptance by
  position from its per-position counter; per file and category from the counters' change over each group of prompts
  (groups never mix categories, so the attribution is exact).
- tokens per second with and without the draft: the same prompts, the same groups of ``--batch-size``, each engine
  warmed up first; the two engines run one after the other in this process (the first shut down before the second
  starts, so each may take ``--gpu-memory-utilization``).
- greedy (temperature 0): each prompt's output with the draft equal to vLLM's without it (lossless).
"""

from __future__ import annotations

import gc
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from rich.console import Console

from .. import __version__
from ..config import SIZE_IT, BenchConfig, EvalConfig, served_model_len
from ..data.eval_prompts import EvalPrompt
from ..errors import EagletError
from ..progress import progress_bar

DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
BY_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Counters:
    """vLLM's speculative-decoding counters (cumulative over an engine's life, or a change between two reads)."""

    drafts: int = 0
    accepted: int = 0
    by_position: list[int] = field(default_factory=list)

    @classmethod
    def read(cls, llm: Any) -> "Counters":
        found = {metric.name: metric for metric in llm.get_metrics()}
        by_position = getattr(found.get(BY_POSITION), "values", None) or []
        return cls(
            int(getattr(found.get(DRAFTS), "value", 0)),
            int(getattr(found.get(ACCEPTED), "value", 0)),
            list(by_position),
        )

    def __sub__(self, before: "Counters") -> "Counters":
        return self._combined(before, -1)

    def __add__(self, other: "Counters") -> "Counters":
        return self._combined(other, 1)

    def _combined(self, other: "Counters", sign: int) -> "Counters":
        width = max(len(self.by_position), len(other.by_position))
        mine = self.by_position + [0] * (width - len(self.by_position))
        theirs = other.by_position + [0] * (width - len(other.by_position))
        return Counters(
            self.drafts + sign * other.drafts,
            self.accepted + sign * other.accepted,
            [a + sign * b for a, b in zip(mine, theirs)],
        )

    def acceptance_length(self) -> float | None:
        """Tokens per target forward, the bonus token included, as vLLM reports it (pooled)."""
        return round(1 + self.accepted / self.drafts, 4) if self.drafts else None


@dataclass
class GroupRun:
    """One group of prompts decoded by one engine: its outputs and seconds."""

    tokens: list[list[int]]
    seconds: float


def groups(prompts: list[EvalPrompt], size: int) -> Iterator[list[EvalPrompt]]:
    """The prompts in groups of at most ``size``, each of one file's one category (counters attribute exactly)."""
    by_category: dict[tuple[str, str], list[EvalPrompt]] = {}
    for prompt in prompts:
        by_category.setdefault((prompt.source, prompt.category), []).append(prompt)
    for rows in by_category.values():
        for start in range(0, len(rows), size):
            yield rows[start : start + size]


class ServingEngine:
    """vLLM on the target, with the draft or without it, kept only while it decodes (``close``)."""

    def __init__(
        self,
        config: EvalConfig | BenchConfig,
        target: Path,
        dtype: str,
        speculative: dict[str, Any] | None,
        max_model_len: int,
    ):
        from ..model.vllm_engine import EngineHold, EngineUse, open_llm

        self.config = config
        self.llm = open_llm(
            EngineHold.of(config, target, dtype, config.seed),
            EngineUse(
                max_model_len=max_model_len,
                speculative_config=speculative,
                disable_log_stats=speculative is None,  # the counters are kept only where a draft runs
            ),
        )

    def decode(self, rows: list[EvalPrompt], stop: list[int], temperature: float) -> GroupRun:
        """``rows`` submitted together (vLLM runs them concurrently), decoded to the end."""
        from vllm import SamplingParams
        from vllm.inputs import tokens_input

        sampling = temperature > 0
        params = SamplingParams(
            max_tokens=self.config.max_new_tokens,
            temperature=temperature,
            top_p=self.config.top_p if sampling else 1.0,
            seed=self.config.seed if sampling else None,
            stop_token_ids=stop,
            detokenize=False,
        )
        started = time.perf_counter()
        outputs = self.llm.generate([tokens_input(row.ids) for row in rows], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        return GroupRun([list(output.outputs[0].token_ids) for output in outputs], seconds)

    def close(self) -> None:
        """Shut vLLM's engine down and free its memory, so the next engine may take its share of the GPU."""
        import torch

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_engine(
    config: EvalConfig,
    target: Path,
    dtype: str,
    speculative: dict[str, Any] | None,
    batches: list[list[EvalPrompt]],
    stop: list[int],
    console: Console,
    max_model_len: int,
) -> tuple[list[GroupRun], list[Counters]]:
    """One engine over every group (after a warm-up on the first): each group's run and counters' change."""
    engine = ServingEngine(config, target, dtype, speculative, max_model_len)
    try:
        engine.decode(batches[0][:1], stop, config.temperature)  # warm-up: compilation, CUDA graphs are not timed
        runs, changes = [], []
        label = "eval (vllm, draft)" if speculative else "eval (vllm, target alone)"
        with progress_bar("prompts", console) as progress:
            task = progress.add_task(label, total=sum(len(batch) for batch in batches))
            for batch in batches:
                before = Counters.read(engine.llm) if speculative else Counters()
                runs.append(engine.decode(batch, stop, config.temperature))
                changes.append(Counters.read(engine.llm) - before if speculative else Counters())
                progress.advance(task, len(batch))
        return runs, changes
    finally:
        engine.close()


def _first_difference(a: list[int], b: list[int]) -> int:
    """The first index where two token lists differ (the shorter one's length when one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _at(tokens: list[int], other: list[int]) -> int | None:
    """``tokens``' token where it first differs from ``other`` (None: it ended there)."""
    position = _first_difference(tokens, other)
    return tokens[position] if position < len(tokens) else None


def _speed(tokens: int, with_s: float, without_s: float, counters: Counters, prompts: int) -> dict[str, Any]:
    return {
        "prompts": prompts,
        "acceptance_length": counters.acceptance_length(),
        "tokens_per_s": round(tokens / with_s, 2) if with_s else None,
        "baseline_tokens_per_s": round(tokens / without_s, 2) if without_s else None,
        "speedup": round(without_s / with_s, 4) if with_s else None,
    }


def serve_eval(
    config: EvalConfig, target: Path, target_name: str, prompts: list[EvalPrompt], stop: list[int], console: Console
) -> dict[str, Any]:
    """The report of the draft served by vLLM beside vLLM alone (the keys `eaglet eval` writes for its own engine,
    plus ``engine: vllm``)."""
    from ..model.target import pick_dtype
    from ..model.vllm_engine import installed_cpu_draft_problem, start_problem, vllm_runs_on, vllm_version

    problem = start_problem(target, config) or installed_cpu_draft_problem(target)
    if problem:
        raise EagletError(problem)
    # eval's float32 default is the hf backend's exact lossless check; vLLM's quantized and MLA kernels run bf16/fp16:
    # here the default is vLLM's serving dtype, and float32 only when asked for
    asked = config.dtype if "dtype" in config.model_fields_set else "auto"
    dtype = str(pick_dtype(asked, vllm_runs_on() or "cuda")).removeprefix("torch.")
    batches = list(groups(prompts, config.batch_size))
    speculative = {
        "method": "eagle3",
        "model": str(Path(config.draft).resolve()),
        "num_speculative_tokens": config.depth,
    }
    max_model_len, too_short = served_model_len(config, max(len(row.ids) for row in prompts))
    if too_short:
        raise EagletError(f"{too_short}; {SIZE_IT}")
    plain, _ = run_engine(config, target, dtype, None, batches, stop, console, max_model_len)
    drafted, counters = run_engine(config, target, dtype, speculative, batches, stop, console, max_model_len)
    greedy = config.temperature <= 0
    # greedy: where each prompt's output with the draft first leaves vLLM's own (vLLM gives no logits to say by how
    # much; eaglet's hf eval does)
    divergences = {
        row.id: {"position": _first_difference(a, b), "target_token": _at(a, b), "speculative_token": _at(b, a)}
        for batch, alone, with_draft in zip(batches, plain, drafted)
        for row, a, b in zip(batch, alone.tokens, with_draft.tokens)
        if greedy and a != b
    }
    failures = list(divergences)
    total = sum(counters, Counters())
    by_source: dict[str, list[int]] = {}
    by_category: dict[str, list[int]] = {}
    several_files = len({row.source for row in prompts}) > 1
    for index, batch in enumerate(batches):
        by_source.setdefault(batch[0].source, []).append(index)
        name = f"{batch[0].source}: {batch[0].category}" if several_files else batch[0].category
        by_category.setdefault(name, []).append(index)

    def summary(indices: list[int]) -> dict[str, Any]:
        tokens = sum(len(t) for i in indices for t in drafted[i].tokens)
        pooled = sum((counters[i] for i in indices), Counters())
        return _speed(
            tokens,
            sum(drafted[i].seconds for i in indices),
            sum(plain[i].seconds for i in indices),
            pooled,
            sum(len(batches[i]) for i in indices),
        )

    overall = summary(list(range(len(batches))))
    positions = total.by_position + [0] * (config.depth - len(total.by_position))
    return {
        "engine": "vllm",
        "acceptance_length": overall["acceptance_length"] or 1.0,
        "acceptance_by_position": [round(count / max(1, total.drafts), 4) for count in positions[: config.depth]],
        "tokens_per_s": overall["tokens_per_s"],
        "baseline_tokens_per_s": overall["baseline_tokens_per_s"],
        "speedup": overall["speedup"],
        "lossless": (not failures) if greedy else None,
        "lossless_failures": failures,
        "divergences": divergences,
        "per_category": {
            name: {"prompts": row["prompts"], "acceptance_length": row["acceptance_length"] or 1.0}
            for name, row in sorted((name, summary(indices)) for name, indices in by_category.items())
        },
        "per_source": {source: summary(indices) for source, indices in sorted(by_source.items())},
        "prompts": len(prompts),
        "generated_tokens": sum(len(t) for run in drafted for t in run.tokens),
        "target_forwards": total.drafts,  # verification steps vLLM ran (one per draft round of each request)
        "vllm_counters": {"drafts": total.drafts, "accepted": total.accepted, "accepted_by_position": positions},
        "settings": {
            "target": target_name,
            "draft": config.draft,
            "mode": "chain",
            "depth": config.depth,
            "topk": None,
            "budget": None,
            "temperature": config.temperature,
            "top_p": config.top_p,
            "max_new_tokens": config.max_new_tokens,
            "batch_size": config.batch_size,
            "split": config.split,
            "device": "vllm",
            "dtype": dtype,
            "seed": config.seed,
            "tensor_parallel_size": config.tensor_parallel_size,
            "enable_expert_parallel": config.enable_expert_parallel,
            "engine": f"vLLM {vllm_version()}: the target and draft as vLLM serves them (compiled, CUDA graphs)",
        },
        "versions": {
            "eaglet": __version__,
            "vllm": vllm_version(),
            "python": platform.python_version(),
            "transformers": __import__("transformers").__version__,
        },
    }
