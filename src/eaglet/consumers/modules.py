"""An engine's draft model built from its released source, as names only: which parameters it has.

The model classes' ``__init__`` bodies run in ``pysubset``'s interpreter on the exported config. A call to
another class of the excerpts builds that class the same way; a call to one of the engine's parameter-holding
layers (``LEAF_LAYERS``: linear layers, norms, embeddings) becomes a leaf with its parameter names; any other
call (attention kernels, rotary tables, activations) holds no parameters. ``named_parameters`` then lists the
model's parameters with torch's naming and de-duplication rules, as the engine's loader sees them.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any, Callable

from .pysubset import Interpreter, Namespace, NotCovered, Unknown

LINEAR_LAYERS = (
    "QKVParallelLinear",
    "MergedColumnParallelLinear",
    "RowParallelLinear",
    "ColumnParallelLinear",
    "ReplicatedLinear",
    "Linear",
)
WEIGHT_LAYERS = ("RMSNorm", "LayerNorm", "VocabParallelEmbedding", "ParallelLMHead", "Embedding")
LINEAR_BIAS_DEFAULT = True  # torch.nn.Linear and the engines' parallel linear layers add a bias unless told not to
MODULE_LIST = ("ModuleList",)
PARAMETER = ("Parameter",)


@dataclass
class Leaf:
    """A parameter-holding layer of the engine's library: ``weight`` and perhaps ``bias``."""

    kind: str
    bias: bool | Unknown = False

    def parameters(self) -> dict[str, bool]:
        """name -> certainly present (False: present or absent, eaglet cannot tell)."""
        params = {"weight": True}
        if isinstance(self.bias, Unknown):
            params["bias"] = False
        elif self.bias:
            params["bias"] = True
        return params


@dataclass
class ModuleList:
    items: list[Any]


@dataclass
class Parameter:
    pass


class Instance(Namespace):
    """An instance of one of the excerpts' classes; its attributes are its submodules and fields."""

    def __init__(self, module: "SourceModule", node: ast.ClassDef):
        super().__init__(node.name)
        self._class = (module, node)
        self._buffers: dict[str, bool] = {}  # name -> persistent

    def register_buffer(self, name: str, value: Any = None, persistent: bool = True) -> None:
        self._buffers[name] = persistent

    def named_buffers(self):  # engines' own loops over buffers are not followed
        raise NotCovered("named_buffers()")


@dataclass
class SourceModule:
    """One file of the excerpts: its top-level symbols (classes, import aliases, module-level assignments)."""

    path: str
    tree: ast.Module
    symbols: dict[str, Any] = field(default_factory=dict)  # name -> ast.ClassDef | ("import", dotted) | alias name
    # the names a class statement's bases saw (``class LlamaDecoderLayer(LlamaDecoderLayer)`` extends the import)
    base_scopes: dict[int, dict[str, Any]] = field(default_factory=dict)


def index_module(path: str, text: str) -> SourceModule:
    """Top-level names, taking the run-time branch of ``if TYPE_CHECKING:`` blocks."""
    module = SourceModule(path, ast.parse(text))

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef):
                if isinstance(node, ast.ClassDef):
                    module.base_scopes[id(node)] = dict(module.symbols)
                module.symbols[node.name] = node
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    module.symbols[alias.asname or alias.name] = ("import", f"{node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    module.symbols[alias.asname or alias.name.split(".")[0]] = ("import", alias.name)
            elif (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Name)
            ):
                module.symbols[node.targets[0].id] = node.value.id
            elif isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                visit(node.orelse)

    visit(module.tree.body)
    return module


def module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


class ModelBuilder:
    """Builds instances of the excerpts' classes. ``facts`` answers the engine's runtime calls (by source
    text, e.g. ``"get_tensor_model_parallel_world_size"``) the model's construction depends on."""

    def __init__(self, sources: dict[str, str], facts: dict[str, Callable[..., Any]]):
        self.modules = {module_name(path): index_module(path, text) for path, text in sources.items()}
        self.facts = facts

    # ------------------------------------------------------------------ names

    def resolve(
        self, module: SourceModule, name: str, hops: int = 0, scope: dict[str, Any] | None = None
    ) -> tuple[SourceModule, ast.AST] | str:
        """A name used in ``module`` (``scope``: the names in effect there, the module's by default): (the
        module defining it, its class/function node), or the dotted name of something outside the excerpts."""
        if hops > 20:
            raise NotCovered(f"alias cycle at {name}")
        symbol = (module.symbols if scope is None else scope).get(name)
        if isinstance(symbol, ast.AST):
            return module, symbol
        if isinstance(symbol, str):
            return self.resolve(module, symbol, hops + 1, scope)
        if isinstance(symbol, tuple):
            dotted = symbol[1]
            owner, _, attr = dotted.rpartition(".")
            if owner in self.modules:
                return self.resolve(self.modules[owner], attr, hops + 1)
            return dotted
        return name

    def resolve_base(
        self, module: SourceModule, node: ast.ClassDef, base: ast.expr
    ) -> tuple[SourceModule, ast.AST] | str:
        return self.resolve(module, ast.unparse(base), scope=module.base_scopes.get(id(node)))

    def class_node(self, module: SourceModule, name: str) -> tuple[SourceModule, ast.ClassDef]:
        found = self.resolve(module, name)
        if isinstance(found, str) or not isinstance(found[1], ast.ClassDef):
            raise NotCovered(f"class {name} is not in the excerpts")
        return found  # type: ignore[return-value]

    # ------------------------------------------------------------------ construction

    def build(self, module_path: str, class_name: str, **kwargs: Any) -> Instance:
        module, node = self.class_node(self.modules[module_path], class_name)
        return self._instantiate(module, node, kwargs)

    def _instantiate(self, module: SourceModule, node: ast.ClassDef, kwargs: dict[str, Any]) -> Instance:
        instance = Instance(module, node)
        for owner_module, owner in reversed(self.lineage(module, node)):  # class attributes, bases first
            interpreter = self._interpreter(owner_module, owner, instance)
            for statement in owner.body:
                if isinstance(statement, ast.Assign) and all(isinstance(t, ast.Name) for t in statement.targets):
                    try:
                        value = interpreter.evaluate(statement.value, {"self": instance})
                    except NotCovered:
                        continue
                    for target in statement.targets:
                        setattr(instance, target.id, value)
        self._init(module, node, instance, kwargs)
        return instance

    def lineage(self, module: SourceModule, node: ast.ClassDef) -> list[tuple[SourceModule, ast.ClassDef]]:
        """The class and its bases found in the excerpts, most derived first (single inheritance chains)."""
        chain = [(module, node)]
        for base in node.bases:
            found = self.resolve_base(module, node, base)
            if not isinstance(found, str) and isinstance(found[1], ast.ClassDef):
                chain += self.lineage(*found)  # type: ignore[arg-type]
                break
        return chain

    def method(self, instance: Instance, name: str) -> tuple[SourceModule, ast.ClassDef, ast.FunctionDef] | None:
        """The function ``instance.name`` runs, from the nearest class of its lineage that defines it."""
        for module, node in self.lineage(*instance._class):
            function = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
            if function is not None:
                return module, node, function
        return None

    def call_method(
        self,
        instance: Instance,
        name: str,
        calls: dict[str, Callable[..., Any]] | None = None,
        trace: Callable | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``instance.name(**kwargs)`` with ``calls`` giving meaning to the engine functions it uses."""
        found = self.method(instance, name)
        if found is None:
            raise NotCovered(f"{instance!r} has no method {name}")
        module, node, function = found
        interpreter = self._interpreter(module, node, instance)
        interpreter.calls = _Overlay(calls or {}, interpreter.calls)
        interpreter.values = {name: value for name, value in (calls or {}).items() if "." not in name}
        interpreter.trace = trace
        return interpreter.call_function(function, {"self": instance, **kwargs})

    def _init(self, module: SourceModule, node: ast.ClassDef, instance: Instance, kwargs: dict[str, Any]) -> None:
        """Run the first ``__init__`` along the class and its bases (within the excerpts) on ``instance``."""
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init is None:
            for base in node.bases:
                found = self.resolve_base(module, node, base)
                if not isinstance(found, str) and isinstance(found[1], ast.ClassDef):
                    self._init(found[0], found[1], instance, kwargs)
                    return
            return
        params = [a.arg for a in init.args.args[1:]]
        bound = {"self": instance, **kwargs}
        interpreter = self._interpreter(module, node, instance)
        interpreter.call_function(init, {**bound, **{p: bound[p] for p in params if p in bound}})

    def _interpreter(self, module: SourceModule, node: ast.ClassDef, instance: Instance) -> Interpreter:
        builder = self

        class ClassCalls(dict):
            """Resolves a callee's source text: super().__init__, the excerpts' classes, leaf layers, facts."""

            def __contains__(self, text: object) -> bool:
                return isinstance(text, str)

            def __getitem__(self, text: str) -> Callable[..., Any]:
                if text == "super().__init__":
                    return lambda *a, **k: builder._super_init(module, node, instance, a, k)
                if text in builder.facts:
                    return builder.facts[text]
                if text.startswith("self."):
                    return lambda *a, **k: builder._self_call(instance, text[len("self.") :], a, k)
                return lambda *a, **k: builder._construct(module, text, a, k)

        def module_global(name: str) -> Any:
            """A module-level name used as a value (``attn_layer_type=LlamaAttention``): a constructor for the
            excerpts' classes and the engine's layers, Unknown for anything else (enums, helpers)."""
            found = builder.resolve(module, name)
            layer = name in LINEAR_LAYERS + WEIGHT_LAYERS + MODULE_LIST + PARAMETER
            if layer or not isinstance(found, str) and isinstance(found[1], ast.ClassDef):
                return lambda *a, **k: builder._construct(module, name, a, k)
            return Unknown(name)

        return Interpreter(calls=ClassCalls(), globals=module_global)

    def _super_init(
        self, module: SourceModule, node: ast.ClassDef, instance: Instance, args: tuple, kwargs: dict
    ) -> None:
        for base in node.bases:
            found = self.resolve_base(module, node, base)
            if isinstance(found, str):
                continue  # nn.Module and other library bases hold no parameters
            base_module, base_node = found
            if not isinstance(base_node, ast.ClassDef):
                continue
            init = next((n for n in base_node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            if init is None:
                return self._super_init(base_module, base_node, instance, args, kwargs)
            params = [a.arg for a in init.args.args[1:]]
            bound = dict(zip(params, args)) | kwargs
            self._interpreter(base_module, base_node, instance).call_function(init, {"self": instance, **bound})
            return None
        return None

    def _self_call(self, instance: Instance, name: str, args: tuple, kwargs: dict) -> Any:
        if name == "register_buffer":
            return instance.register_buffer(*args, **kwargs)
        return Unknown(f"self.{name}(...)")  # helper methods (quant configs, patches): no parameters come of them

    def _construct(self, module: SourceModule, text: str, args: tuple, kwargs: dict) -> Any:
        last = text.rsplit(".", 1)[-1]
        if last in MODULE_LIST:
            return ModuleList(list(args[0]) if args and not isinstance(args[0], Unknown) else [])
        if last in PARAMETER:
            return Parameter()
        if last in LINEAR_LAYERS:
            return Leaf(last, kwargs.get("bias", LINEAR_BIAS_DEFAULT))
        if last in WEIGHT_LAYERS:
            return Leaf(last)
        found = self.resolve(module, text) if "." not in text else text
        if not isinstance(found, str) and isinstance(found[1], ast.ClassDef):
            init = next((n for n in found[1].body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            params = [a.arg for a in init.args.args[1:]] if init is not None else []
            return self._instantiate(found[0], found[1], dict(zip(params, args)) | kwargs)
        return Unknown(f"{text}(...)")  # kernels, rotary tables, activations: no loadable parameters


class _Overlay(dict):
    """Call meanings: the caller's first, then the builder's."""

    def __init__(self, first: dict[str, Callable[..., Any]], second: Any):
        super().__init__()
        self.first, self.second = first, second

    def __contains__(self, text: object) -> bool:
        return text in self.first or text in self.second

    def __getitem__(self, text: str) -> Callable[..., Any]:
        return self.first[text] if text in self.first else self.second[text]


def named_parameters(root: Instance) -> dict[str, bool]:
    """Parameter names as torch lists them (registration order, shared modules once): name -> certainly present."""
    out: dict[str, bool] = {}
    seen: set[int] = set()

    def walk(value: Any, prefix: str) -> None:
        if id(value) in seen:
            return
        if isinstance(value, Parameter):
            seen.add(id(value))
            out[prefix] = True
        elif isinstance(value, Leaf):
            seen.add(id(value))
            for name, certain in value.parameters().items():
                out[f"{prefix}.{name}"] = certain
        elif isinstance(value, ModuleList):
            seen.add(id(value))
            for index, item in enumerate(value.items):
                walk(item, f"{prefix}.{index}")
        elif isinstance(value, Instance):
            seen.add(id(value))
            for name, child in vars(value).items():
                if not name.startswith("_"):
                    walk(child, f"{prefix}.{name}" if prefix else name)

    walk(root, "")
    return out


def buffers(root: Instance) -> dict[str, bool]:
    """Registered buffers (name -> persistent) of the instance tree."""
    out: dict[str, bool] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, ModuleList):
            for index, item in enumerate(value.items):
                walk(item, f"{prefix}.{index}")
        elif isinstance(value, Instance):
            for name, persistent in value._buffers.items():
                out[f"{prefix}.{name}" if prefix else name] = persistent
            for name, child in vars(value).items():
                if not name.startswith("_"):
                    walk(child, f"{prefix}.{name}" if prefix else name)

    walk(root, "")
    return out
