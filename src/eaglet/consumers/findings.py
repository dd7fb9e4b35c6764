"""What a consumer check finds, and the one reading that both engines' capture loops share."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from .pysubset import Namespace, NotCovered


class Weight(Namespace):
    """An exported tensor on its way through an engine's loader: its name travels, its data is never needed
    (any attribute of it, like ``.shape``, reads as unknown)."""

    def __init__(self, source: str):
        super().__init__("weight", {"source": source})


@dataclass
class LoadReport:
    """Where an engine puts each exported tensor."""

    engine: str
    loaded: dict[str, str] = field(default_factory=dict)  # exported tensor -> engine parameter
    consumed: dict[str, str] = field(default_factory=dict)  # exported tensor -> how the loader uses it otherwise
    skipped: dict[str, str] = field(default_factory=dict)  # exported tensor -> the rule that skips it
    errors: list[str] = field(default_factory=list)  # the engine would raise, or drop a tensor it needs
    unfilled: list[str] = field(default_factory=list)  # engine parameters nothing fills (left at their init)


def skip_tracer(report: LoadReport, name_variable: str = "name", weight_variable: str = "loaded_weight"):
    """A statement trace for an engine's load loop: a ``continue`` records the exported tensor it skips (with
    the last condition taken), an assignment to ``self.X`` from the tensor records that the loader keeps it there."""
    last_test: list[str] = [""]
    outer_continues: set[int] = set()  # the `continue`s of the loop over the weights (not of loops inside it)

    def own_continues(body: list[ast.stmt]) -> set[int]:
        found: set[int] = set()
        for statement in body:
            if isinstance(statement, ast.Continue):
                found.add(id(statement))
            elif isinstance(statement, ast.If | ast.With | ast.Try):
                for part in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(statement, part, []):
                        found |= own_continues(child.body if isinstance(child, ast.ExceptHandler) else [child])
        return found

    def trace(node: ast.stmt, env: dict) -> None:
        if isinstance(node, ast.For) and weight_variable in {
            n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)
        }:
            outer_continues.update(own_continues(node.body))
        weight = env.get(weight_variable)
        source = getattr(weight, "source", None)
        if source is None:
            return
        if isinstance(node, ast.If):
            last_test[0] = ast.unparse(node.test)
        elif isinstance(node, ast.Continue) and id(node) in outer_continues and source not in report.loaded:
            report.skipped.setdefault(source, f"`if {last_test[0]}: continue`")
        elif (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Attribute) and ast.unparse(t).startswith("self.") for t in node.targets)
            and any(isinstance(n, ast.Name) and n.id == weight_variable for n in ast.walk(node.value))
        ):
            report.consumed[source] = ast.unparse(node).splitlines()[0]

    return trace


def _calls_named(node: ast.AST, name: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Call)
        and (
            isinstance(n.func, ast.Attribute)
            and n.func.attr == name
            or isinstance(n.func, ast.Name)
            and n.func.id == name
        )
    ]


def capture_offset(forward: ast.FunctionDef, hook: str) -> int:
    """What to add to the label a model's forward records an aux hidden state under to get eaglet's id (the input
    of decoder layer i). Read from the layer loop: a record made after ``layer(...)`` under ``idx + c`` holds the
    output of layer ``idx`` (= the input of ``idx + 1``); one made before it, the input of layer ``idx``."""
    for loop in [n for n in ast.walk(forward) if isinstance(n, ast.For)]:
        if not (
            isinstance(loop.target, ast.Tuple)
            and len(loop.target.elts) == 2
            and all(isinstance(e, ast.Name) for e in loop.target.elts)
        ):
            continue
        index, layer = (e.id for e in loop.target.elts)  # type: ignore[union-attr]
        layer_at = hook_at = None
        label = None
        for position, statement in enumerate(loop.body):
            if layer_at is None and any(
                isinstance(c.func, ast.Name) and c.func.id == layer for c in _calls_named(statement, layer)
            ):
                layer_at = position
            for call in _calls_named(statement, hook):
                if len(call.args) >= 2:
                    hook_at, label = position, call.args[1]
        if layer_at is None or hook_at is None or label is None:
            continue
        if isinstance(label, ast.Name) and label.id == index:
            shift = 0
        elif (
            isinstance(label, ast.BinOp)
            and isinstance(label.op, ast.Add)
            and isinstance(label.left, ast.Name)
            and label.left.id == index
            and isinstance(label.right, ast.Constant)
        ):
            shift = int(label.right.value)
        else:
            raise NotCovered(f"aux capture labelled `{ast.unparse(label)}`")
        return (1 - shift) if hook_at > layer_at else -shift
    raise NotCovered(f"no layer loop recording aux states through {hook} in {forward.name}")


NORM_OUTPUT_FLAG = "norm_output"


def feeds_back_normed(model: Namespace, forward: ast.FunctionDef) -> bool:
    """Whether the engine's draft feeds its next step the hidden state after the final norm (EAGLE 3.1's
    ``norm_output``): the flag as the engine's own ``__init__`` set it on the built inner model, where the inner
    model's ``forward`` chooses its fed-back output by it. A forward that never reads the flag returns the pre-norm
    state beside the logits' input (EAGLE-3's)."""
    reads_flag = any(
        isinstance(node, ast.Attribute) and node.attr == NORM_OUTPUT_FLAG and ast.unparse(node.value) == "self"
        for node in ast.walk(forward)
    )
    if not reads_flag:
        return False
    inner = getattr(model, "model", None)
    if not isinstance(inner, Namespace) or NORM_OUTPUT_FLAG not in vars(inner):
        raise NotCovered(f"the built draft has no model.{NORM_OUTPUT_FLAG} though its forward reads it")
    return vars(inner)[NORM_OUTPUT_FLAG] is True
