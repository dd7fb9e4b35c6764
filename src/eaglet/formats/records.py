"""Typed records of what eaglet keeps on disk: the one validation layer every reader of an artifact goes through.

A record is a pydantic model of one metadata file (a store manifest, a shard record, a prepared set's manifest, a
draft config). Reading one checks every field its readers use — present, of its JSON type (strict: "64" is not an
int, true is not a number), finite, in range — and the rules between fields (counts that add up, layer ids inside
the target), so a crafted or damaged file is refused in one line before any of it is used. The models live beside
their readers (``formats.store``, ``formats.prepared``, ``formats.draft``); this module holds what they share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from ..errors import EagletError, shown
from .files import RUN_SCHEMA

RECORD_CONFIG = ConfigDict(strict=True, allow_inf_nan=False, extra="allow", populate_by_name=True)

SHA256_PATTERN = r"^[0-9a-f]{64}$"
Sha256 = Annotated[str, StringConstraints(pattern=SHA256_PATTERN)]
Count = Annotated[int, Field(ge=0)]
Positive = Annotated[int, Field(ge=1)]


class Record(BaseModel):
    """A metadata file's fields; fields eaglet does not read are kept as they are (``extra="allow"``)."""

    model_config = RECORD_CONFIG


RecordT = TypeVar("RecordT", bound=Record)


def validation_line(error: ValidationError) -> str:
    """The first problem of a record as ``'a.b': what (got X)``."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "(top level)"
    if first["type"] == "missing":
        return f"'{where}' is missing"
    message = first["msg"].removeprefix("Value error, ")
    return f"'{where}': {message}" + ("" if first["type"] == "value_error" else f" (got {shown(first.get('input'))})")


def parse_record(model: type[RecordT], data: Any, path: Path | str, fix: str) -> RecordT:
    """``data`` (a decoded JSON file at ``path``) as ``model``, or one line naming the file, the field and ``fix``."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise EagletError(f"{path}: {validation_line(exc)}; {fix}") from None


class RunRecord(Record):
    """RUN/run.json: per stage of `eaglet run`, the fingerprint it was made with and whether it finished."""

    schema_: Literal[RUN_SCHEMA] = Field(alias="schema")
    stages: dict[str, dict[str, Any]]
