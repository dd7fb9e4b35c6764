"""A stage command's options, generated from its config's pydantic fields: each setting is declared once.

A field's name gives the option (``max_new_tokens`` -> ``--max-new-tokens``), its description the help, its
default and Literal choices the rest of the help. Every option defaults to None ("not given"), so the precedence
of ``config.build_config`` holds: field defaults < the YAML file < options given < ``--set``. Values that are
not one word on a command line are read the way ``--set`` reads them: ``--layers 2,15,27``,
``--max-memory cuda:0=60GiB,cpu=200GiB``, ``--betas 0.9,0.95``, ``--tune-trees '[[7,8,56],[8,8,64]]'``.
"""

from __future__ import annotations

import inspect
import json
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, List, Literal, Optional, Union, get_args, get_origin

import typer
from pydantic import ConfigDict, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from rich.markup import escape
from rich.table import Table

from ..config import StrictModel, build_config, parse_override
from ..errors import EagletError, shown
from .console import err_console, out_console

CONFIG_HELP = "YAML config file (flat, or with a section named after the stage)"
SKIP_HELP = "skip the preflight checks (problems then surface after the model load)"
SET_HELP = "override a config key: --set key=value (repeatable)"
Parser = Callable[[str, str], Any]  # (option, text) -> the value the config field validates


def _parse_sequence(option: str, text: str) -> Any:
    """``2,15,27`` or a YAML flow list (``[[7,8,56],[8,8,64]]``) as a list; items are YAML scalars."""
    if text.strip().startswith("["):
        return parse_override(f"{option}={text}")[1]
    return [parse_override(f"{option}={item.strip()}")[1] for item in text.split(",") if item.strip()]


def _parse_mapping(option: str, text: str) -> dict[str, str]:
    """``cuda:0=60GiB,cpu=200GiB`` as a mapping (--max-memory is the one mapping option)."""
    pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
    if any(len(pair) != 2 for pair in pairs):
        raise EagletError(f"{option} {text!r}: expected DEVICE=SIZE pairs, e.g. cuda:0=60GiB,cpu=200GiB")
    return {key.strip(): value.strip() for key, value in pairs}


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [arg for arg in get_args(annotation) if arg is not type(None)]
        return rest[0] if len(rest) == 1 else str
    if get_origin(annotation) is Annotated:
        return get_args(annotation)[0]
    return annotation


def cli_type(annotation: Any) -> tuple[Any, Parser | None]:
    """The type typer parses an option as, and the parser that turns its text into the field's value (or None)."""
    base = _without_none(annotation)
    origin = get_origin(base)
    if base in (bool, int, float, str):
        return Optional[base], None
    if origin is Literal:
        return Optional[str], None
    if origin is list and get_args(base) and _without_none(get_args(base)[0]) is str:
        return Optional[List[str]], None  # repeatable: --engine A --engine B
    if origin in (list, tuple):
        return Optional[str], _parse_sequence
    if origin is dict:
        return Optional[str], _parse_mapping
    raise TypeError(f"no command-line form for a field of type {annotation!r}")


def choices(field: FieldInfo) -> tuple[str, ...]:
    base = _without_none(field.annotation)
    return tuple(str(choice) for choice in get_args(base)) if get_origin(base) is Literal else ()


def option_help(field: FieldInfo) -> str:
    """The field's description, its choices and its default, as one help line."""
    parts = [field.description or ""]
    if choices(field):
        parts.append(f"({' | '.join(choices(field))})")
    default = field.get_default(call_default_factory=True)
    if field.is_required():
        parts.append("(required)")
    elif default not in (None, False, [], {}, ""):
        if isinstance(default, (list, tuple)):
            nested = any(isinstance(item, (list, tuple)) for item in default)
            default = json.dumps(default) if nested else ",".join(map(str, default))
        parts.append(f"(default: {default})")
    return escape(" ".join(part for part in parts if part))  # help is rich markup: "[a, b]" stays text


def option_names(name: str, field: FieldInfo, renamed: dict[str, str], short: dict[str, str]) -> list[str]:
    flag = renamed.get(name, "--" + name.replace("_", "-"))
    if _without_none(field.annotation) is bool and field.default is True:
        flag = f"{flag}/--no-{flag[2:]}"
    return [flag] + ([short[name]] if name in short else [])


def _own_fields_first(config_class: type[StrictModel]) -> list[tuple[str, FieldInfo]]:
    """The stage's own settings, then those it shares with other stages (the placement's)."""
    own = set(config_class.__annotations__)
    fields = list(config_class.model_fields.items())
    return [item for item in fields if item[0] in own] + [item for item in fields if item[0] not in own]


def option_value(option: str, text: Any, field: FieldInfo, parse: Parser | None) -> Any:
    """An option's value as its field holds it. A value read from text (a list, a mapping) that its field refuses
    is named as typed (``--layers '1,x,3'``); a plain value is validated with the rest of the config."""
    if parse is None:
        return text
    value = parse(option, text)
    try:
        TypeAdapter(Annotated[field.annotation, field], config=ConfigDict(allow_inf_nan=False)).validate_python(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        index = first["loc"][0] + 1 if first["loc"] and isinstance(first["loc"][0], int) else None
        problem = first["msg"] + (f" (item {index})" if index else "")
        if first["type"] == "missing" and index:
            problem = f"item {index} is missing"
        raise EagletError(f"{option} {shown(text)}: {problem}") from None
    return value


@dataclass
class StageOptions:
    """What a stage command was given; ``build()`` merges it into the typed config and runs the preflight."""

    ctx: typer.Context
    stage: str
    config_class: type[StrictModel]
    values: dict[str, Any]
    config_file: Path | None
    overrides: list[str]
    skip_preflight: bool
    options: dict[str, str]  # config key -> its command-line option (positional fields have none)

    def build(self) -> Any:
        cfg = build_config(self.config_class, self.stage, self.config_file, self.values, self.overrides, self.options)
        run_preflight(self.ctx, self.stage, cfg, self.skip_preflight)
        return cfg


def stage_command(
    app: typer.Typer,
    config_class: type[StrictModel],
    stage: str,
    *,
    command_name: str | None = None,
    arguments: tuple[str, ...] = (),
    short: dict[str, str] | None = None,
    renamed: dict[str, str] | None = None,
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register ``body(options: StageOptions, **own)`` as the ``stage`` command with one option per config field.

    ``arguments`` are fields taken positionally; ``short`` adds a short flag (``{"out": "-o"}``), ``renamed``
    another long one (``{"engines": "--engine"}``); ``body``'s own parameters (typer options) come first."""
    short, renamed = short or {}, renamed or {}

    def decorate(body: Callable[..., None]) -> Callable[..., None]:
        own = [p for p in inspect.signature(body, eval_str=True).parameters.values() if p.name != "options"]
        flags: dict[str, str] = {}
        parsers: dict[str, Parser | None] = {}
        generated = []
        for name, field in _own_fields_first(config_class):
            annotation, parsers[name] = cli_type(field.annotation)
            names = option_names(name, field, renamed, short)
            flags[name] = names[0].split("/")[0]  # how an error names the option
            if name in arguments:
                default = typer.Argument(None, help=option_help(field), show_default=False)
            else:
                default = typer.Option(None, *names, help=option_help(field), show_default=False)
            generated.append(
                inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
            )
        common = [
            inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context),
            inspect.Parameter(
                "skip_preflight",
                inspect.Parameter.KEYWORD_ONLY,
                annotation=bool,
                default=typer.Option(False, "--skip-preflight", help=SKIP_HELP),
            ),
            inspect.Parameter(
                "config",
                inspect.Parameter.KEYWORD_ONLY,
                annotation=Optional[Path],
                default=typer.Option(None, "--config", "-c", help=CONFIG_HELP),
            ),
            inspect.Parameter(
                "overrides",
                inspect.Parameter.KEYWORD_ONLY,
                annotation=List[str],
                default=typer.Option([], "--set", help=SET_HELP),
            ),
        ]
        ordered = (
            [p for p in generated if p.name in arguments]
            + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
            + [p for p in generated if p.name not in arguments]
            + common
        )

        def command(**given: Any) -> None:
            values = {}
            for name, parse in parsers.items():
                value = given.pop(name)
                if value is not None:
                    value = option_value(flags[name], value, config_class.model_fields[name], parse)
                values[name] = value
            options = StageOptions(
                given.pop("ctx"),
                stage,
                config_class,
                values,
                given.pop("config"),
                given.pop("overrides"),
                given.pop("skip_preflight"),
                {name: flag for name, flag in flags.items() if name not in arguments},
            )
            body(options, **given)

        command.__signature__ = inspect.Signature(ordered)  # type: ignore[attr-defined]
        command.__name__, command.__doc__ = body.__name__, body.__doc__
        app.command(command_name or stage)(command)
        return body

    return decorate


def run_preflight(ctx: typer.Context, stage: str, cfg: object, skip: bool) -> None:
    """Run the stage's checks; under `eaglet preflight` print them and exit, otherwise stop on a failure."""
    from ..preflight.stages import FAIL, WARN, run_checks, worst

    mode = ctx.obj if isinstance(ctx.obj, dict) else {}
    if skip and not mode.get("only"):
        err_console.print(
            f"[bold yellow]PREFLIGHT SKIPPED for {stage} (--skip-preflight): anything wrong surfaces "
            "only after the expensive part starts[/]"
        )
        return
    started = time.perf_counter()
    checks = run_checks(stage, cfg)
    status = worst(checks)
    seconds = time.perf_counter() - started
    if mode.get("only"):
        if mode.get("json"):
            out_console.print_json(
                json.dumps(
                    {
                        "stage": stage,
                        "status": status,
                        "seconds": round(seconds, 3),
                        "checks": [c.as_dict() for c in checks],
                    }
                )
            )
        else:
            out_console.print(_checks_table(stage, checks, seconds))
        raise typer.Exit(2 if status == FAIL else 1 if status == WARN and mode.get("strict") else 0)
    if status == FAIL:  # one line: the first failed check and its fix (`eaglet preflight STAGE ...` lists them all)
        first = next(c for c in checks if c.status == FAIL)
        raise EagletError(first.refusal(stage))
    for check in checks:
        if check.status == WARN:
            err_console.print(f"[yellow]preflight warning[/] {check.name}: {check.detail}", highlight=False)


def _checks_table(stage: str, checks: list, seconds: float) -> Table:
    styles = {"pass": "green", "warn": "yellow", "fail": "bold red"}
    table = Table(title=f"preflight {stage} ({seconds:.2f} s)")
    for column in ("check", "status", "detail", "fix"):
        table.add_column(column)
    for check in checks:
        table.add_row(check.name, f"[{styles[check.status]}]{check.status}[/]", escape(check.detail), escape(check.fix))
    return table
