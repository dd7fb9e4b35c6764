"""A small interpreter for the part of Python that serving engines' weight loaders and config readers use.

The engines cannot be imported here (they need GPUs and their own stacks), so eaglet runs the relevant
functions of their released source on plain values: strings (tensor names), numbers, dicts, lists and a
config object. Statements and expressions outside that subset raise ``NotCovered`` naming the line, so a
loader that changes shape in a new release is reported as "not covered", never guessed at. Values that
depend on things eaglet cannot know (a GPU's state, an object it does not model) are ``Unknown``.
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

MAX_LOOP_ITERATIONS = 100_000


class NotCovered(Exception):
    """The source uses a construct this interpreter does not follow."""


@dataclass(frozen=True)
class Unknown:
    """A value that cannot be known without running the engine."""

    reason: str

    def __bool__(self) -> bool:
        raise NotCovered(f"a decision depends on an unknown value ({self.reason})")


class Namespace:
    """An object with attributes (``self``, a config): missing attributes read as ``Unknown``."""

    def __init__(self, name: str, values: dict[str, Any] | None = None):
        self._name = name
        self.__dict__.update(values or {})

    def __repr__(self) -> str:
        return f"<{self._name}>"


class ConfigObject(Namespace):
    """An HF-style config read by attribute (``config.hidden_size``) with ``getattr`` defaults, as engines do."""

    def __init__(self, values: dict[str, Any]):
        super().__init__("config", {k: (ConfigDict(v) if isinstance(v, dict) else v) for k, v in values.items()})


class ConfigDict(dict):
    """A nested config dict (``eagle_config``): read with ``.get`` and ``[]``."""


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


class _Return(Exception):
    def __init__(self, value: Any):
        self.value = value


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.BitOr: operator.or_,
    ast.BitAnd: operator.and_,
}
_COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_STR_METHODS = {"replace", "startswith", "endswith", "split", "rsplit", "join", "strip", "format", "lower"}
_DICT_METHODS = {"get", "items", "keys", "values"}
_BUILTINS: dict[str, Callable] = {
    "len": len,
    "bool": bool,
    "int": int,
    "str": str,
    "range": range,
    "list": list,
    "tuple": tuple,
    "dict": dict,
    "isinstance": lambda v, t: isinstance(v, t),
    "sorted": sorted,
    "set": set,
    "max": max,
    "min": min,
    "any": any,
    "all": all,
}
_TYPES = {"dict": dict, "list": list, "tuple": tuple, "str": str, "int": int}


def _getattr(obj: Any, name: str, *default: Any) -> Any:
    if isinstance(obj, Namespace):
        if name in obj.__dict__:
            return obj.__dict__[name]
        return default[0] if default else Unknown(f"{obj!r}.{name}")
    if isinstance(obj, Unknown):
        return obj
    if isinstance(obj, str) and name in _STR_METHODS or isinstance(obj, dict) and name in _DICT_METHODS:
        return getattr(obj, name)
    if isinstance(obj, (list, tuple)) and name in ("index", "count"):
        return getattr(obj, name)
    if obj is None or isinstance(obj, (bool, int, float, str, dict, list, tuple)):
        if default:
            return default[0]
        raise AttributeError(f"{type(obj).__name__!r} object has no attribute {name!r}")  # as Python would
    raise NotCovered(f"attribute {name!r} of a {type(obj).__name__}")


@dataclass
class Interpreter:
    """Runs statements on an environment of names. ``calls`` gives meaning to the engine's own functions
    (by the callee's source text, e.g. ``"AutoWeightsLoader"``): each gets the evaluated arguments."""

    calls: dict[str, Callable[..., Any]] = field(default_factory=dict)
    globals: Callable[[str], Any] | None = None  # module-level names (classes as constructors), when not local
    trace: Callable[[ast.stmt, dict[str, Any]], None] | None = None  # called before each statement runs
    values: dict[str, Any] = field(default_factory=dict)  # module-level names given meaning by the caller

    # ------------------------------------------------------------------ statements

    def run(self, body: list[ast.stmt], env: dict[str, Any]) -> Any:
        """Execute ``body``; returns what a ``return`` gave (None otherwise)."""
        try:
            for statement in body:
                self.execute(statement, env)
        except _Return as returned:
            return returned.value
        return None

    def call_function(self, function: ast.FunctionDef, args: dict[str, Any]) -> Any:
        """Run a function's body with its parameters bound (missing ones take their literal defaults)."""
        env = dict(args)
        params = function.args.args + function.args.kwonlyargs
        defaults = [None] * (len(function.args.args) - len(function.args.defaults)) + function.args.defaults
        defaults += function.args.kw_defaults
        for param, default in zip(params, defaults):
            if param.arg not in env and default is not None:
                env[param.arg] = self.evaluate(default, env)
        return self.run(function.body, env)

    def execute(self, node: ast.stmt, env: dict[str, Any]) -> None:
        if self.trace is not None:
            self.trace(node, env)
        if isinstance(node, (ast.Pass, ast.Import, ast.ImportFrom, ast.Assert, ast.FunctionDef, ast.ClassDef)):
            return
        if isinstance(node, ast.Expr):
            if not isinstance(node.value, ast.Constant):  # docstrings
                self.evaluate(node.value, env)
        elif isinstance(node, ast.Assign):
            value = self.evaluate(node.value, env)
            for target in node.targets:
                self.assign(target, value, env)
        elif isinstance(node, ast.AnnAssign):
            if node.value is not None:
                self.assign(node.target, self.evaluate(node.value, env), env)
        elif isinstance(node, ast.AugAssign):
            op = _BINARY.get(type(node.op))
            if op is None or not isinstance(node.target, ast.Name):
                raise NotCovered(self.where(node))
            env[node.target.id] = op(self.evaluate(node.target, env), self.evaluate(node.value, env))
        elif isinstance(node, ast.If):
            self.run_block(node.body if self.truth(node.test, env) else node.orelse, env)
        elif isinstance(node, ast.For):
            self.run_for(node, env)
        elif isinstance(node, ast.With):
            self.run_block(node.body, env)
        elif isinstance(node, ast.Try):
            self.run_try(node, env)
        elif isinstance(node, ast.Continue):
            raise _Continue
        elif isinstance(node, ast.Break):
            raise _Break
        elif isinstance(node, ast.Return):
            raise _Return(None if node.value is None else self.evaluate(node.value, env))
        elif isinstance(node, ast.Raise):
            raise EngineRaises(self.where(node))
        else:
            raise NotCovered(self.where(node))

    def run_block(self, body: list[ast.stmt], env: dict[str, Any]) -> None:
        for statement in body:
            self.execute(statement, env)

    def run_try(self, node: ast.Try, env: dict[str, Any]) -> None:
        """The errors plain Python raises on these values (a missing key, an attribute of None) go to the
        engine's handlers as they would; the interpreter's own NotCovered does not."""
        try:
            self.run_block(node.body, env)
        except PYTHON_ERRORS as error:
            for handler in node.handlers:
                names = (
                    []
                    if handler.type is None
                    else [
                        ast.unparse(t)
                        for t in (handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type])
                    ]
                )
                if not names or any(n in ("Exception", "BaseException", type(error).__name__) for n in names):
                    self.run_block(handler.body, env)
                    break
            else:
                raise
        else:
            self.run_block(node.orelse, env)
        finally:
            self.run_block(node.finalbody, env)

    def run_for(self, node: ast.For, env: dict[str, Any]) -> None:
        iterable = self.evaluate(node.iter, env)
        if isinstance(iterable, Unknown):
            raise NotCovered(f"{self.where(node)}: loops over an unknown value ({iterable.reason})")
        for count, item in enumerate(iterable):
            if count > MAX_LOOP_ITERATIONS:
                raise NotCovered(f"{self.where(node)}: too many iterations")
            self.assign(node.target, item, env)
            try:
                self.run_block(node.body, env)
            except _Continue:
                continue
            except _Break:
                return
        self.run_block(node.orelse, env)

    def assign(self, target: ast.expr, value: Any, env: dict[str, Any]) -> None:
        if isinstance(target, ast.Name):
            env[target.id] = value
        elif isinstance(target, (ast.Tuple, ast.List)):
            values = list(value)
            if len(values) != len(target.elts):
                raise NotCovered(f"unpacking {len(values)} values into {len(target.elts)} names")
            for element, item in zip(target.elts, values):
                self.assign(element, item, env)
        elif isinstance(target, ast.Subscript):
            container = self.evaluate(target.value, env)
            if not isinstance(container, (dict, list)):
                raise NotCovered(f"item assignment into a {type(container).__name__}")
            container[self.evaluate(target.slice, env)] = value
        elif isinstance(target, ast.Attribute):
            owner = self.evaluate(target.value, env)
            if isinstance(owner, Unknown):
                return  # a field of something not modelled (a config copy, a kernel object): nothing to track
            if not isinstance(owner, Namespace):
                raise NotCovered(f"attribute assignment on a {type(owner).__name__}")
            setattr(owner, target.attr, value)
        else:
            raise NotCovered(f"assignment to {ast.unparse(target)}")

    def truth(self, test: ast.expr, env: dict[str, Any]) -> bool:
        value = self.evaluate(test, env)
        if isinstance(value, Unknown):
            raise NotCovered(f"the condition `{ast.unparse(test)}` depends on {value.reason}")
        return bool(value)

    # ------------------------------------------------------------------ expressions

    def evaluate(self, node: ast.expr, env: dict[str, Any]) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id]
            if node.id in self.values:
                return self.values[node.id]
            if node.id in _BUILTINS:
                return _BUILTINS[node.id]
            if self.globals is not None:
                return self.globals(node.id)
            return Unknown(node.id)
        if isinstance(node, ast.Attribute):
            return _getattr(self.evaluate(node.value, env), node.attr)
        if isinstance(node, ast.JoinedStr):
            return "".join(
                str(self.evaluate(v.value, env)) if isinstance(v, ast.FormattedValue) else v.value for v in node.values
            )
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = [self.evaluate(e, env) for e in node.elts]
            return tuple(items) if isinstance(node, ast.Tuple) else set(items) if isinstance(node, ast.Set) else items
        if isinstance(node, ast.Dict):
            return {self.evaluate(k, env): self.evaluate(v, env) for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.BoolOp):
            result = None
            for value_node in node.values:
                result = self.evaluate(value_node, env)
                if isinstance(result, Unknown):
                    return result
                if isinstance(node.op, ast.And) and not result or isinstance(node.op, ast.Or) and result:
                    return result
            return result
        if isinstance(node, ast.UnaryOp):
            operand = self.evaluate(node.operand, env)
            if isinstance(operand, Unknown):
                return operand
            if isinstance(node.op, ast.Not):
                return not operand
            if isinstance(node.op, ast.USub):
                return -operand
            raise NotCovered(ast.unparse(node))
        if isinstance(node, ast.BinOp):
            left, right = self.evaluate(node.left, env), self.evaluate(node.right, env)
            for side in (left, right):
                if isinstance(side, Unknown):
                    return side
            op = _BINARY.get(type(node.op))
            if op is None:
                raise NotCovered(ast.unparse(node))
            return op(left, right)
        if isinstance(node, ast.Compare):
            left = self.evaluate(node.left, env)
            for op_node, right_node in zip(node.ops, node.comparators):
                right = self.evaluate(right_node, env)
                if isinstance(left, Unknown) or isinstance(right, Unknown):
                    return left if isinstance(left, Unknown) else right
                if not _COMPARE[type(op_node)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            test = self.evaluate(node.test, env)
            if isinstance(test, Unknown):
                return test
            return self.evaluate(node.body if test else node.orelse, env)
        if isinstance(node, ast.Subscript):
            container, key = self.evaluate(node.value, env), self.evaluate(node.slice, env)
            if isinstance(container, Unknown):
                return container
            if isinstance(container, (dict, list, tuple, str)):
                return container[key]
            raise NotCovered(f"subscript of a {type(container).__name__}: {ast.unparse(node)}")
        if isinstance(node, ast.Slice):
            parts = [None if p is None else self.evaluate(p, env) for p in (node.lower, node.upper, node.step)]
            return slice(*parts)
        if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
            items = self.comprehension(node, env)
            return set(items) if isinstance(node, ast.SetComp) else items
        if isinstance(node, ast.NamedExpr):
            value = self.evaluate(node.value, env)
            env[node.target.id] = value
            return value
        if isinstance(node, ast.Call):
            return self.call(node, env)
        if isinstance(node, ast.Lambda):
            raise NotCovered(ast.unparse(node))
        raise NotCovered(f"expression {ast.unparse(node)}")

    def comprehension(self, node: ast.ListComp | ast.GeneratorExp | ast.SetComp, env: dict[str, Any]) -> list:
        if len(node.generators) != 1:
            raise NotCovered(ast.unparse(node))
        generator = node.generators[0]
        iterable = self.evaluate(generator.iter, env)
        if isinstance(iterable, Unknown):
            return iterable  # type: ignore[return-value]
        scope = dict(env)
        out = []
        for item in iterable:
            self.assign(generator.target, item, scope)
            if all(self.truth(condition, scope) for condition in generator.ifs):
                out.append(self.evaluate(node.elt, scope))
        return out

    def call(self, node: ast.Call, env: dict[str, Any]) -> Any:
        text = ast.unparse(node.func)
        args = [self.evaluate(a.value if isinstance(a, ast.Starred) else a, env) for a in node.args]
        if any(isinstance(a, ast.Starred) for a in node.args):
            raise NotCovered(f"star arguments: {ast.unparse(node)}")
        kwargs = {k.arg: self.evaluate(k.value, env) for k in node.keywords if k.arg is not None}
        if text == "getattr":
            return _getattr(*args)
        if text == "hasattr":
            value = _getattr(args[0], args[1], _MISSING)
            return value is not _MISSING and not isinstance(value, Unknown)
        if text == "isinstance" and isinstance(node.args[1], ast.Name) and node.args[1].id in _TYPES:
            return isinstance(args[0], _TYPES[node.args[1].id])
        if text in _BUILTINS and text not in env:
            return _BUILTINS[text](*args, **kwargs)
        head = text.split(".", 1)[0]
        if (head == "self" or head not in env) and text in self.calls:  # local values' methods run as Python's
            return self.calls[text](*args, **kwargs)
        function = self.evaluate(node.func, env)
        if isinstance(function, Unknown):
            return Unknown(f"the result of {text}(...)")
        if callable(function):
            return function(*args, **kwargs)
        raise NotCovered(f"call of {text}")

    def where(self, node: ast.AST) -> str:
        return f"line {getattr(node, 'lineno', '?')}: {ast.unparse(node).splitlines()[0][:100]}"


_MISSING = object()
PYTHON_ERRORS = (AttributeError, KeyError, TypeError, IndexError, ValueError)


class EngineRaises(Exception):
    """The engine's own code raises on this input (a real failure of the export, not of the reader)."""
