"""Parameters, and Python's argument binding rules applied to a call site."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    POSITIONAL_ONLY = "positional-only"
    POSITIONAL_OR_KEYWORD = "positional or keyword"
    VAR_POSITIONAL = "variadic positional"
    KEYWORD_ONLY = "keyword-only"
    VAR_KEYWORD = "variadic keyword"


@dataclass(frozen=True)
class Param:
    name: str
    kind: Kind
    has_default: bool


@dataclass(frozen=True)
class Signature:
    params: tuple[Param, ...]
    ignores_unknown_keywords: bool = False  # e.g. a pydantic model with extra="ignore": accepted, then dropped

    def drop_first(self) -> "Signature":
        """The signature seen through a bound method (``self``/``cls`` already given)."""
        params = self.params
        if params and params[0].kind in (Kind.POSITIONAL_ONLY, Kind.POSITIONAL_OR_KEYWORD):
            params = params[1:]
        return Signature(params, self.ignores_unknown_keywords)

    @property
    def named(self) -> set[str]:
        """The parameters a keyword argument can name."""
        return {p.name for p in self.params if p.kind in (Kind.POSITIONAL_OR_KEYWORD, Kind.KEYWORD_ONLY)}

    @property
    def accepts_anything(self) -> bool:
        kinds = {p.kind for p in self.params}
        return Kind.VAR_POSITIONAL in kinds and Kind.VAR_KEYWORD in kinds


@dataclass(frozen=True)
class CallShape:
    positional: int  # plain positional arguments
    keywords: tuple[str, ...]  # explicit keyword names, in order
    star: bool = False  # *iterable present: the positional count is unknown
    double_star: bool = False  # **mapping present: more keywords may come


@dataclass(frozen=True)
class Problem:
    level: str  # "error" or "warning"
    message: str


def bind(signature: Signature, call: CallShape) -> list[Problem]:
    """What Python would raise (TypeError) binding ``call`` to ``signature``; unknowable parts are skipped."""
    params = signature.params
    positional_slots = [p for p in params if p.kind in (Kind.POSITIONAL_ONLY, Kind.POSITIONAL_OR_KEYWORD)]
    var_positional = any(p.kind is Kind.VAR_POSITIONAL for p in params)
    var_keyword = any(p.kind is Kind.VAR_KEYWORD for p in params)
    problems: list[Problem] = []
    filled: set[str] = set()
    if not call.star:
        if call.positional > len(positional_slots) and not var_positional:
            problems.append(
                Problem(
                    "error",
                    f"takes {len(positional_slots)} positional argument"
                    f"{'' if len(positional_slots) == 1 else 's'} but {call.positional} were given",
                )
            )
        filled.update(p.name for p in positional_slots[: call.positional])
    by_name = {p.name: p for p in params if p.kind in (Kind.POSITIONAL_OR_KEYWORD, Kind.KEYWORD_ONLY)}
    for keyword in call.keywords:
        param = by_name.get(keyword)
        if param is None:
            if var_keyword:
                continue
            if signature.ignores_unknown_keywords:
                problems.append(Problem("warning", f"keyword '{keyword}' is not a field and is silently ignored"))
                continue
            positional_only = any(p.name == keyword and p.kind is Kind.POSITIONAL_ONLY for p in params)
            what = "is positional-only" if positional_only else "is not a parameter"
            problems.append(Problem("error", f"unexpected keyword argument '{keyword}' ({what})"))
        elif keyword in filled:
            problems.append(Problem("error", f"got multiple values for argument '{keyword}'"))
        filled.add(keyword)
    if not call.star and not call.double_star:
        missing = [
            p.name
            for p in params
            if not p.has_default
            and p.name not in filled
            and p.kind in (Kind.POSITIONAL_ONLY, Kind.POSITIONAL_OR_KEYWORD, Kind.KEYWORD_ONLY)
        ]
        if missing:
            problems.append(
                Problem(
                    "error",
                    "missing required argument"
                    + ("s " if len(missing) > 1 else " ")
                    + ", ".join(f"'{m}'" for m in missing),
                )
            )
    elif call.star and not call.double_star:  # positionals unknown: only keyword-only requirements are certain
        missing = [p.name for p in params if p.kind is Kind.KEYWORD_ONLY and not p.has_default and p.name not in filled]
        if missing:
            problems.append(
                Problem(
                    "error",
                    "missing required keyword-only argument"
                    + ("s " if len(missing) > 1 else " ")
                    + ", ".join(f"'{m}'" for m in missing),
                )
            )
    return problems
