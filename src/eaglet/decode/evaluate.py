"""`eaglet eval`: what a draft is worth — acceptance length τ, speedup over the same engine without a draft
(same process), and a lossless check of every greedy output against the target's own — written as report.json,
report.md and PNG plots. The decoders themselves come from ``decoders.make_decoders``."""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from .. import __version__
from ..config import BenchConfig, EvalConfig
from ..data.eval_prompts import EvalPrompt, select_prompts
from ..errors import EagletError
from ..formats.draft_config import SERVED_BY_VLLM, read_draft_config, require_export, require_fits_target
from ..formats.eval_report import draft_weights_digest
from ..formats.files import REPORT_FILE, REPORT_MARKDOWN_FILE
from ..formats.target_record import other_weights, require_same_target, stage_target
from ..fsio import check_output_apart, check_output_dir, write_json_atomic
from ..model.distributed import from_main, init_distributed
from ..model.draft import load_draft
from ..model.placement import input_device, output_device
from ..model.target import (
    context_length,
    generation_eos,
    load_head_weights,
    load_model,
    load_tokenizer,
    resolve_target,
    target_info,
)
from ..progress import progress_bar
from .common import acceptance_length
from .decoders import check_settings, make_decoders
from .runners import TargetRunner
from .tune import tune_tree


@dataclass
class PromptResult:
    id: str
    source: str
    category: str
    tokens: int
    forwards: int
    accepted: list[int]
    spec_s: float
    base_s: float
    lossless: bool | None
    divergence: dict[str, Any] | None = None  # where a greedy output left the target's own (``_divergence``)


def _divergence(
    model: Any, layer_ids: tuple[int, ...], prompt: list[int], expected: list[int], got: list[int]
) -> dict[str, Any]:
    """Where the speculative output first left the target's own greedy decoding, and how much the target
    preferred its own token there: the logit gap, also in units of the dtype's rounding at that logit
    (eps * |logit|). A gap of a few units is a near-tie that a k-token verification's different rounding
    can flip (bf16); a large one would be a decoder bug. Costs one extra target forward per failing prompt,
    outside the timings."""
    position = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    record: dict[str, Any] = {"position": position}
    if position < min(len(expected), len(got)):
        checker = TargetRunner(model, layer_ids)
        checker.reset()
        logits = checker.forward(prompt + expected[:position])[0][-1]  # [V]: the target's step that chose expected
        chosen = float(logits[expected[position]])
        gap = chosen - float(logits[got[position]])
        unit = torch.finfo(next(model.parameters()).dtype).eps * max(abs(chosen), 1.0)
        record.update(
            target_token=expected[position],
            speculative_token=got[position],
            logit_gap=round(gap, 5),
            rounding_units=round(gap / unit, 2),
        )
    return record


def _tuning_prompts(
    config: EvalConfig, tokenizer: Any, context: int | None, evaluated: list[EvalPrompt]
) -> tuple[list[EvalPrompt], str]:
    """Prompts to time tree shapes on: the train split's when held-out prompts are evaluated (the shape is not
    chosen on the prompts it is judged on), else the first evaluated ones."""
    if config.split == "heldout":
        try:
            train = config.model_copy(update={"split": "train", "max_prompts": config.tune_prompts})
            chosen = select_prompts(train, tokenizer, context, each_file=False, skip_too_long=True)
            return chosen[: config.tune_prompts], "train split"
        except EagletError:  # the prompt files have no train split
            pass
    return evaluated[: config.tune_prompts], "evaluated prompts"


def _tuned(
    config: EvalConfig, build: Any, prompts: list[list[int]], tuned_on: str, dist: Any, device: str
) -> tuple[EvalConfig, dict[str, Any]]:
    """The config with the tree shape ``tune_tree`` found fastest (rank 0's under torchrun: ranks time apart but
    must decode alike), and the report's record of the tuning."""
    fastest, trees = tune_tree(config, build, prompts)
    chosen = from_main(fastest, dist, device)
    tuned = config.model_copy(update=dict(zip(("depth", "topk", "budget"), chosen)))
    return tuned, {"prompts": len(prompts), "prompts_from": tuned_on, "trees": trees, "chosen": chosen}


def _hf_generate_tokens_per_s(model: Any, prompts: list[list[int]], max_new: int, stop: list[int]) -> float:
    device = input_device(model)
    tokens, started = 0, time.perf_counter()
    for ids in prompts:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids], device=device),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=stop,
                pad_token_id=stop[0],
            )
        tokens += out.shape[1] - len(ids)
    return tokens / (time.perf_counter() - started)


def run_eval(config: EvalConfig, console: Console | None = None) -> dict[str, Any]:
    console = console or Console(stderr=True)
    check_settings(config)
    check_output_dir(config.out)  # before the decode, not after it
    check_output_apart(config.out, [config.draft, *config.prompts, config.target])
    resolved = resolve_target(stage_target(config), config.trust_remote_code)
    tokenizer = load_tokenizer(resolved.path, config.trust_remote_code)
    info = target_info(resolved, tokenizer)
    draft_config = draft_for(config, info, resolved.path, console)
    context = context_length(resolved.path)
    prompts = select_prompts(config, tokenizer, context)  # before the target loads: a bad prompt file is known now
    if config.backend == "vllm":
        from .vllm_serving import serve_eval

        stop = stop_ids(tokenizer, generation_eos(resolved.path))
        report = serve_eval(config, resolved.path, info.name, prompts, stop, console)
        return _write_report(config, report)
    draft = load_draft(
        config.draft, embed=load_head_weights(resolved.path).embed.float(), target_layers=info.num_layers
    )
    layer_ids = tuple(draft_config.eagle_aux_hidden_state_layer_ids)
    dist = init_distributed()  # --placement tp: every rank runs the same decoding; rank 0 reports
    device = dist.device(config.device)
    model = load_model(resolved.path, device, config.dtype, config.trust_remote_code, config, dist.world)
    device = str(output_device(model))  # the draft runs where the target's logits and features come out
    draft = draft.to(device=device, dtype=next(model.parameters()).dtype).eval()
    greedy = config.temperature <= 0
    stop = stop_ids(tokenizer, model.generation_config.eos_token_id)
    tuning = None
    if config.tune:
        tune_rows, tuned_on = _tuning_prompts(config, tokenizer, context, prompts)
        longest = max(len(row.ids) for row in prompts + tune_rows)
        config, tuning = _tuned(
            config,
            lambda shaped: make_decoders(shaped, model, draft, layer_ids, set(stop), longest, device, console),
            [row.ids for row in tune_rows],
            tuned_on,
            dist,
            device,
        )
        console.print(
            f"eaglet eval --tune: tree {'/'.join(map(str, tuning['chosen']))} ("
            + ", ".join(f"{'/'.join(map(str, t['tree']))}: {t['tokens_per_s']:.1f} tok/s" for t in tuning["trees"])
            + ")"
        )
    decoders = make_decoders(
        config, model, draft, layer_ids, set(stop), max(len(p.ids) for p in prompts), device, console
    )
    decoders.warm_up([row.ids for row in prompts[: decoders.group_size]])
    results = []
    with progress_bar("prompts", console) as progress:
        task = progress.add_task("eval", total=len(prompts))
        for start in range(0, len(prompts), decoders.group_size):
            group = prompts[start : start + decoders.group_size]
            ids = [row.ids for row in group]
            base = decoders.baseline(ids, config.max_new_tokens, config.seed + start)
            spec = decoders.speculative(ids, config.max_new_tokens, config.seed + start)
            for row, plain, drafted in zip(group, base, spec):
                lossless = (drafted.tokens == plain.tokens) if greedy else None
                divergence = (
                    _divergence(model, layer_ids, row.ids, plain.tokens, drafted.tokens) if lossless is False else None
                )
                results.append(
                    PromptResult(
                        row.id,
                        row.source,
                        row.category,
                        len(drafted.tokens),
                        drafted.forwards,
                        drafted.accepted,
                        drafted.seconds,
                        plain.seconds,
                        lossless,
                        divergence,
                    )
                )
            progress.advance(task, len(group))
    report = _report(config, results, info.name, str(device))
    report["settings"].update(decoders.settings)
    if tuning is not None:
        report["tuning"] = tuning
    if config.hf_generate_baseline:
        report["hf_generate_tokens_per_s"] = round(
            _hf_generate_tokens_per_s(model, [p.ids for p in prompts], config.max_new_tokens, stop), 2
        )
    return _write_report(config, report, dist.is_main)


def draft_for(config: EvalConfig | BenchConfig, info: Any, target: Path, console: Console) -> Any:
    """The draft's config, refused when it was trained for another target (``--backend vllm``: when it is not a
    directory vLLM loads); a warning when trained on other weights of the same target."""
    stored = require_export(config.draft, SERVED_BY_VLLM, info.num_layers) if config.backend == "vllm" else None
    stored = stored or read_draft_config(config.draft, info.num_layers)
    draft_config = stored.config
    if stored.made_elsewhere:  # no record of its target: what can be known is that it fits this one
        require_fits_target(draft_config, info.name, info.vocab_size, info.hidden_size, str(config.draft))
        return draft_config
    require_same_target(
        info.identity,
        draft_config.target,
        str(config.draft),
        "trained for",
        "pass the matching --target",
        config_only=True,
    )
    if other_weights(info.identity, draft_config.target):
        console.print(
            f"[yellow]warning[/] {config.draft} was trained against other weights of {info.name} than "
            f"{target} holds (a new fine-tune saved there since?): τ measures the draft on weights it never saw",
            highlight=False,
        )
    return draft_config


def stop_ids(tokenizer: Any, generation_eos: int | list[int] | None) -> list[int]:
    """Where a decode ends: the tokenizer's end of sequence and the generation config's."""
    ends = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    return sorted({i for i in [tokenizer.eos_token_id, *ends] if i is not None})


def _write_report(config: EvalConfig, report: dict[str, Any], writes: bool = True) -> dict[str, Any]:
    """report.json (with the draft's weights digest: export checks its report is this draft's), report.md, plots."""
    report["draft_weights_sha256"] = draft_weights_digest(config.draft)
    if writes:
        out = Path(config.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / REPORT_FILE, report)
        (out / REPORT_MARKDOWN_FILE).write_text(_markdown(report), encoding="utf-8")
        _plots(report, out)
    return report


def _speed(items: list[PromptResult]) -> dict[str, Any]:
    """τ and speed over some prompts: tokens over the seconds each engine took for them."""
    tokens = sum(r.tokens for r in items)
    spec_s, base_s = sum(r.spec_s for r in items), sum(r.base_s for r in items)
    return {
        "prompts": len(items),
        "acceptance_length": round(acceptance_length(items), 4),
        "tokens_per_s": round(tokens / spec_s, 2) if spec_s else None,
        "baseline_tokens_per_s": round(tokens / base_s, 2) if base_s else None,
        "speedup": round(base_s / spec_s, 4) if spec_s else None,
    }


def _grouped(results: list[PromptResult], key: Any) -> dict[str, list[PromptResult]]:
    groups: dict[str, list[PromptResult]] = {}
    for result in results:
        groups.setdefault(key(result), []).append(result)
    return dict(sorted(groups.items()))


def _taus(results: list[PromptResult], key: Any) -> dict[str, dict[str, Any]]:
    """Prompts and τ of each group of ``results`` (by ``key``: category, or file and category)."""
    return {
        name: {"prompts": len(items), "acceptance_length": round(acceptance_length(items), 4)}
        for name, items in _grouped(results, key).items()
    }


def _report(config: EvalConfig, results: list[PromptResult], target_name: str, device: str) -> dict[str, Any]:
    tokens = sum(r.tokens for r in results)
    forwards = sum(r.forwards for r in results)
    rounds = [a for r in results for a in r.accepted]
    overall = _speed(results)
    by_source = _grouped(results, lambda r: r.source)
    # categories of different files can share a name (demo's and MT-Bench's "writing"): named by file when several
    category_of = (lambda r: r.category) if len(by_source) == 1 else (lambda r: f"{r.source}: {r.category}")
    lossless = [r.lossless for r in results if r.lossless is not None]
    return {
        "acceptance_length": overall["acceptance_length"],
        "acceptance_by_position": [
            round(sum(a > i for a in rounds) / max(1, len(rounds)), 4) for i in range(config.depth)
        ],
        "tokens_per_s": overall["tokens_per_s"],
        "baseline_tokens_per_s": overall["baseline_tokens_per_s"],
        "speedup": overall["speedup"],
        "lossless": all(lossless) if lossless else None,
        "lossless_failures": [r.id for r in results if r.lossless is False],
        "divergences": {r.id: r.divergence for r in results if r.divergence is not None},
        "per_category": _taus(results, category_of),
        "per_source": {
            source: {**_speed(items), "per_category": _taus(items, lambda r: r.category)}
            for source, items in by_source.items()
        },
        "prompts": len(results),
        "generated_tokens": tokens,
        "target_forwards": forwards,
        "settings": {
            "target": target_name,
            "draft": config.draft,
            "mode": config.mode,
            "depth": config.depth,
            "topk": config.topk if config.mode == "tree" else None,
            "budget": config.budget if config.mode == "tree" else None,
            "temperature": config.temperature,
            "top_p": config.top_p,
            "max_new_tokens": config.max_new_tokens,
            "batch_size": config.batch_size,
            "split": config.split,
            "device": device,
            "dtype": config.dtype,
            "seed": config.seed,
        },
        "versions": {
            "eaglet": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "transformers": __import__("transformers").__version__,
        },
    }


def _engine_words(settings: dict[str, Any]) -> str:
    if settings.get("device") == "vllm":
        return settings["engine"]
    if not settings.get("static_cache"):
        return "dynamic KV caches, eager kernels"
    graphs = "replayed as CUDA graphs" if settings.get("cuda_graphs") else "run eagerly (no GPU)"
    drafted = (
        "each round (draft, verification, acceptance) one replay, the baseline's step one replay"
        if settings.get("static_draft")
        else "the draft eager (sampling)"
    )
    return f"static KV caches, the target's forwards {graphs}; {drafted}"


def _divergence_lines(report: dict[str, Any]) -> list[str]:
    gaps = [d for d in report.get("divergences", {}).values() if "logit_gap" in d]
    if not gaps:
        return []
    widest = max(gaps, key=lambda d: d["logit_gap"])
    return [
        f"- {len(report['lossless_failures'])} prompts diverged; where they did, the target preferred its own token "
        f"by at most {widest['logit_gap']:.4g} logits ({widest['rounding_units']:.3g}× its dtype's rounding at that "
        "logit): per prompt in report.json `divergences`"
    ]


def _markdown(report: dict[str, Any]) -> str:
    settings = report["settings"]
    lines = [
        f"# eaglet eval: {settings['draft']} on {settings['target']}",
        "",
        f"- acceptance length τ: **{report['acceptance_length']:.2f}** tokens per target forward "
        f"({settings['mode']}, depth {settings['depth']}, temperature {settings['temperature']})",
        f"- speed: {report['tokens_per_s']} tok/s vs {report['baseline_tokens_per_s']} tok/s without the draft "
        f"(same engine, same process): **{report['speedup']:.2f}×**",
        f"- lossless (greedy outputs identical to the target's own): {report['lossless']}"
        + (
            f" (in {settings['dtype']}: a k-token verify rounds differently from a 1-token step, so near-tied tokens can "
            "flip; `--dtype float32` checks exactly)"
            if report["lossless"] is False and settings["dtype"] != "float32"
            else ""
        ),
        *_divergence_lines(report),
        f"- {report['prompts']} prompts ({settings['split']} split), {report['generated_tokens']} tokens, device {settings['device']}",
        f"- engine: {_engine_words(settings)}",
        "",
        *_source_lines(report["per_source"]),
        "| category | prompts | τ |",
        "|---|---|---|",
        *[
            f"| {name} | {row['prompts']} | {row['acceptance_length']:.2f} |"
            for name, row in report["per_category"].items()
        ],
        "",
        "Acceptance by draft position: " + ", ".join(f"{p:.2f}" for p in report["acceptance_by_position"]),
        "",
        *_tuning_lines(report.get("tuning")),
        "![acceptance by position](acceptance_by_position.png) ![τ by category](tau_by_category.png)",
        "",
    ]
    return "\n".join(lines)


def _source_lines(per_source: dict[str, Any]) -> list[str]:
    """Each prompt file's τ and speedup, when the eval read several (held-out, written elsewhere, synthesized)."""
    if len(per_source) < 2:
        return []
    return [
        "| prompts from | prompts | τ | tok/s | without the draft | speedup |",
        "|---|---|---|---|---|---|",
        *[
            f"| {name} | {row['prompts']} | {row['acceptance_length']:.2f} | {row['tokens_per_s']} | "
            f"{row['baseline_tokens_per_s']} | {row['speedup']:.2f}× |"
            for name, row in per_source.items()
        ],
        "",
    ]


def _tuning_lines(tuning: dict[str, Any] | None) -> list[str]:
    if not tuning:
        return []
    return [
        f"Tree shape chosen by timing ({tuning['prompts']} prompts, {tuning['prompts_from']}):",
        "",
        "| depth/top-k/budget | tok/s | τ |",
        "|---|---|---|",
        *[
            f"| {'/'.join(map(str, t['tree']))}{' (chosen)' if t['tree'] == tuning['chosen'] else ''} | "
            f"{t['tokens_per_s']:.1f} | {t['acceptance_length']:.2f} |"
            for t in tuning["trees"]
        ],
        "",
    ]


def _plots(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    positions = range(1, len(report["acceptance_by_position"]) + 1)
    ax.bar(positions, report["acceptance_by_position"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of rounds accepted")
    ax.set_ylim(0, 1)
    ax.set_title(f"acceptance by position (τ = {report['acceptance_length']:.2f})")
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_position.png", dpi=120)
    plt.close(fig)
    categories = report["per_category"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(list(categories), [row["acceptance_length"] for row in categories.values()])
    ax.set_ylabel("τ")
    ax.set_title("acceptance length by category")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(out / "tau_by_category.png", dpi=120)
    plt.close(fig)
