"""The caller's side: every import of and call into the library, with what each callee expression names.

Values are tracked through the caller's code without running it: names bound by imports of every form
(inside functions and try blocks too, relative imports of the caller's own modules that re-export library
names), variables and ``self.x`` attributes typed by annotations or by assignment from a library
constructor or from a function whose return annotation names a library class.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .signature import Kind, Param, Signature

IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException", "AttributeError"}


@dataclass(frozen=True)
class Ref:
    """A library object named by a dotted path (a module, class, function, attribute)."""

    path: str


@dataclass(frozen=True)
class Instance:
    """An instance of a library class."""

    class_path: str


@dataclass(frozen=True)
class Untyped:
    """A value that came from the library but whose type is not known."""

    reason: str


@dataclass(frozen=True)
class CallerClass:
    """A class defined in the caller's code, with its library bases (if any)."""

    module: str
    name: str
    library_bases: tuple[str, ...]


Value = Ref | Instance | Untyped | CallerClass | None


@dataclass
class Site:
    """An import or a call that reaches into the library."""

    kind: str  # "import", "call", "subclass" (a caller class on a library base) or "override" (its method)
    path: Path
    line: int
    callee: Value  # call: what is called
    receiver: str  # "function", "bound" (through an instance: self/cls given), "class-access" (Class.method(...))
    member: str | None  # bound: the method name looked up on the instance's class
    positional: int = 0
    keywords: tuple[str, ...] = ()
    star: bool = False
    double_star: bool = False
    guard: str | None = None  # "ImportError handler" or "version check"
    text: str = ""
    unverified: str | None = None  # why this call into the library cannot be checked
    signature: Signature | None = None  # override: the caller's method, as the library will call it (no self)
    defines: tuple[str, ...] = ()  # subclass: the methods the caller class defines


@dataclass
class CallerModule:
    name: str
    path: Path
    tree: ast.Module
    source: str
    scope: dict[str, Value] = field(default_factory=dict)
    classes: dict[str, dict[str, Value]] = field(default_factory=dict)  # caller class -> attribute -> value


def module_name(root: Path, file: Path) -> str:
    relative = file.relative_to(root).with_suffix("")
    parts = list(relative.parts)
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([root.name, *parts]) if root.is_dir() else file.stem


def discover(paths: list[Path]) -> list[CallerModule]:
    modules = []
    for root in paths:
        files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
        for file in files:
            source = file.read_text(encoding="utf-8", errors="replace")
            try:
                tree = ast.parse(source, filename=str(file))
            except SyntaxError:
                continue  # not Python this interpreter reads; nothing to check there
            modules.append(CallerModule(module_name(root, file) if root.is_dir() else file.stem, file, tree, source))
    return modules


class Analyzer:
    """Walks caller modules; ``library_exports(path)`` lists the names ``from path import *`` binds."""

    def __init__(self, package: str, modules: list[CallerModule], library_exports, returns_of):
        self.package = package
        self.modules = {m.name: m for m in modules}
        self.library_exports = library_exports
        self.returns_of = returns_of  # Ref path -> Instance | Untyped | None (a library function's return)
        self.sites: list[Site] = []

    def in_library(self, dotted: str) -> bool:
        return dotted == self.package or dotted.startswith(self.package + ".")

    # ------------------------------------------------------------------ passes

    def run(self) -> list[Site]:
        for _ in range(3):  # module scopes, re-exports between caller modules settle in a few rounds
            for module in self.modules.values():
                self._module_scope(module)
        for module in self.modules.values():
            self._collect_self_attributes(module)
        for module in self.modules.values():
            self._walk(module, module.tree.body, dict(module.scope), guard=None, current_class=None)
        return self.sites

    def _module_scope(self, module: CallerModule) -> None:
        scope: dict[str, Value] = {}
        for node in _top_level(module.tree.body):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self._bind_import(module, node, scope, guard=None, record=False)
            elif isinstance(node, ast.ClassDef):
                bases = tuple(
                    v.path for v in (self._eval(b, scope, module, None) for b in node.bases) if isinstance(v, Ref)
                )
                scope[node.name] = CallerClass(module.name, node.name, bases)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                self._bind_assignment(node, scope, module, None)
        module.scope = scope

    def _collect_self_attributes(self, module: CallerModule) -> None:
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.ClassDef):
                continue
            attributes = module.classes.setdefault(node.name, {})
            for item in node.body:  # class-level annotations: `engine: Engine`
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    value = self._annotation(item.annotation, module.scope, module)
                    if value is not None:
                        attributes[item.target.id] = value
            for method in [i for i in node.body if isinstance(i, (ast.FunctionDef, ast.AsyncFunctionDef))]:
                scope = dict(module.scope)
                self._bind_parameters(method, scope, module, node.name)
                for statement in ast.walk(method):
                    for target in assigned_targets(statement):
                        if (
                            isinstance(target, ast.Attribute)
                            and isinstance(target.value, ast.Name)
                            and target.value.id == "self"
                        ):
                            if isinstance(statement, ast.AnnAssign):
                                value = self._annotation(statement.annotation, scope, module)
                            else:
                                value = self._eval(statement.value, scope, module, None, record=False)
                            if value is not None:
                                attributes[target.attr] = value

    # ------------------------------------------------------------------ statements

    def _walk(
        self,
        module: CallerModule,
        body: list[ast.stmt],
        scope: dict[str, Value],
        guard: str | None,
        current_class: str | None,
    ) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self._bind_import(module, node, scope, guard, record=True)
            elif isinstance(node, ast.ClassDef):
                for expr in node.bases + node.decorator_list:
                    self._eval(expr, scope, module, guard)
                self._library_subclass(module, node, scope, guard)
                self._walk(module, node.body, dict(scope), guard, node.name)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for expr in node.decorator_list + node.args.defaults + [d for d in node.args.kw_defaults if d]:
                    self._eval(expr, scope, module, guard)
                local = dict(scope)
                self._bind_parameters(node, local, module, current_class)
                self._walk(module, node.body, local, guard, None)
            elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
                catches = {name for handler in node.handlers for name in _exception_names(handler)}
                inner = (
                    "ImportError handler"
                    if catches & IMPORT_ERRORS or any(h.type is None for h in node.handlers)
                    else guard
                )
                self._walk(module, node.body, scope, inner or guard, current_class)
                for handler in node.handlers:
                    self._walk(module, handler.body, scope, guard, current_class)
                self._walk(module, node.orelse, scope, guard, current_class)
                self._walk(module, node.finalbody, scope, guard, current_class)
            elif isinstance(node, ast.If):
                self._eval(node.test, scope, module, guard)
                versioned = "version check" if _is_version_check(node.test) else guard
                self._walk(module, node.body, scope, versioned, current_class)
                self._walk(module, node.orelse, scope, versioned, current_class)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                self._bind_assignment(node, scope, module, guard)
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith)):
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.expr):
                        self._eval(child, scope, module, guard)
                    elif isinstance(child, ast.withitem):
                        value = self._eval(child.context_expr, scope, module, guard)
                        if isinstance(child.optional_vars, ast.Name):
                            scope[child.optional_vars.id] = None if not isinstance(value, Instance) else value
                self._walk(module, node.body, scope, guard, current_class)
                self._walk(module, getattr(node, "orelse", []), scope, guard, current_class)
            else:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.expr):
                        self._eval(child, scope, module, guard)

    def _library_subclass(
        self, module: CallerModule, node: ast.ClassDef, scope: dict[str, Value], guard: str | None
    ) -> None:
        """A class of the caller's on a library base: the library calls its methods (a plugin, a connector), so each
        method that overrides one of the base's must take the base's call, and every abstract method must exist."""
        bases = [
            v for v in (self._eval(b, scope, module, None, record=False) for b in node.bases) if isinstance(v, Ref)
        ]
        if not bases:
            return
        methods = [i for i in node.body if isinstance(i, (ast.FunctionDef, ast.AsyncFunctionDef))]
        base = Ref(bases[0].path)
        self._site("subclass", module, node, base, guard, defines=tuple(m.name for m in methods))
        for method in methods:
            if method.name.startswith("__") and method.name.endswith("__"):
                continue  # constructors and protocols are the caller's own business
            self._site("override", module, method, base, guard, member=method.name, signature=_own_signature(method))

    def _bind_parameters(
        self,
        function: ast.FunctionDef | ast.AsyncFunctionDef,
        scope: dict[str, Value],
        module: CallerModule,
        current_class: str | None,
    ) -> None:
        arguments = function.args.posonlyargs + function.args.args + function.args.kwonlyargs
        for index, argument in enumerate(arguments):
            if index == 0 and current_class is not None and argument.arg in ("self", "cls"):
                scope[argument.arg] = CallerClass(module.name, current_class, ())
                continue
            scope[argument.arg] = self._annotation(argument.annotation, scope, module) if argument.annotation else None

    def _bind_assignment(
        self, node: ast.Assign | ast.AnnAssign, scope: dict[str, Value], module: CallerModule, guard: str | None
    ) -> None:
        if isinstance(node, ast.AnnAssign):
            value = self._annotation(node.annotation, scope, module)
            if node.value is not None:
                assigned = self._eval(node.value, scope, module, guard)
                value = value or assigned
            targets = [node.target]
        else:
            value = self._eval(node.value, scope, module, guard)
            targets = node.targets
        for target in targets:
            if isinstance(target, ast.Name):
                scope[target.id] = value

    def _bind_import(
        self,
        module: CallerModule,
        node: ast.Import | ast.ImportFrom,
        scope: dict[str, Value],
        guard: str | None,
        record: bool,
    ) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if self.in_library(alias.name):
                    if record:
                        self._site("import", module, node, Ref(alias.name), guard)
                    scope[alias.asname or alias.name.split(".")[0]] = Ref(
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
                elif alias.name in self.modules:
                    scope[alias.asname or alias.name.split(".")[0]] = None
            return
        source = self._absolute(module, node)
        if source is None:
            return
        if self.in_library(source):
            for alias in node.names:
                if alias.name == "*":
                    for name in self.library_exports(source) or []:
                        scope[name] = Ref(f"{source}.{name}")
                    continue
                if record:
                    self._site("import", module, node, Ref(f"{source}.{alias.name}"), guard)
                scope[alias.asname or alias.name] = Ref(f"{source}.{alias.name}")
        elif source in self.modules:  # the caller's own module, which may re-export library names
            exporter = self.modules[source]
            for alias in node.names:
                if alias.name == "*":
                    for name, value in exporter.scope.items():
                        if not name.startswith("_"):
                            scope[name] = value
                else:
                    scope[alias.asname or alias.name] = exporter.scope.get(alias.name)

    def _absolute(self, module: CallerModule, node: ast.ImportFrom) -> str | None:
        if not node.level:
            return node.module
        package = module.name.split(".")
        if module.path.name != "__init__.py":
            package = package[:-1]
        if node.level > 1:
            package = package[: len(package) - (node.level - 1)]
        return ".".join(package + ([node.module] if node.module else [])) or None

    # ------------------------------------------------------------------ expressions

    def _annotation(self, annotation: ast.expr | None, scope: dict[str, Value], module: CallerModule) -> Value:
        """``x: Engine`` / ``x: "Engine"`` / ``x: Optional[Engine]`` / ``Engine | None`` -> Instance(Engine)."""
        if annotation is None:
            return None
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            try:
                annotation = ast.parse(annotation.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
            return self._annotation(annotation.left, scope, module) or self._annotation(annotation.right, scope, module)
        if isinstance(annotation, ast.Subscript):
            head = self._eval(annotation.value, scope, module, None, record=False)
            if isinstance(head, Ref) and not self.in_library(head.path):
                return None
            inner = annotation.slice
            elements = inner.elts if isinstance(inner, ast.Tuple) else [inner]
            if isinstance(annotation.value, (ast.Name, ast.Attribute)) and _last_name(annotation.value) in (
                "Optional",
                "Union",
                "Annotated",
            ):
                for element in elements:
                    value = self._annotation(element, scope, module)
                    if value is not None:
                        return value
                return None
            return Instance(head.path) if isinstance(head, Ref) else None
        value = self._eval(annotation, scope, module, None, record=False)
        return Instance(value.path) if isinstance(value, Ref) else None

    def _eval(
        self, node: ast.expr, scope: dict[str, Value], module: CallerModule, guard: str | None, record: bool = True
    ) -> Value:
        """What an expression refers to; records every call into the library met on the way."""
        if isinstance(node, ast.Name):
            return scope.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._eval(node.value, scope, module, guard, record)
            if isinstance(base, _Super):  # super().name inside a caller class deriving from a library class
                library_bases = self._library_bases(base.cls)
                return _Bound(library_bases[0], node.attr) if library_bases else None
            if isinstance(base, Ref):
                return Ref(f"{base.path}.{node.attr}")
            if isinstance(base, Instance):
                return _Bound(base.class_path, node.attr)
            if isinstance(base, CallerClass):
                attributes = self.modules[base.module].classes.get(base.name, {}) if base.module in self.modules else {}
                if node.attr in attributes:
                    return attributes[node.attr]
                library_bases = self._library_bases(base)
                if library_bases and not self._caller_defines(base, node.attr):
                    return _Bound(library_bases[0], node.attr)
                return None
            if isinstance(base, Untyped):
                return Untyped(base.reason)
            return None
        if isinstance(node, ast.Call):
            return self._call(node, scope, module, guard, record)
        if isinstance(node, ast.Await):
            return self._eval(node.value, scope, module, guard, record)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self._eval(child, scope, module, guard, record)
            elif isinstance(child, ast.comprehension):
                for part in [child.iter, *child.ifs]:
                    self._eval(part, scope, module, guard, record)
            elif isinstance(child, ast.keyword):
                self._eval(child.value, scope, module, guard, record)
        return None

    def _call(
        self, node: ast.Call, scope: dict[str, Value], module: CallerModule, guard: str | None, record: bool
    ) -> Value:
        for argument in node.args:
            self._eval(argument.value if isinstance(argument, ast.Starred) else argument, scope, module, guard, record)
        for keyword in node.keywords:
            self._eval(keyword.value, scope, module, guard, record)
        if isinstance(node.func, ast.Name) and node.func.id == "super" and not node.args:
            owner = scope.get("self") or scope.get("cls")
            return _Super(owner) if isinstance(owner, CallerClass) else None
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args:
            target = self._eval(node.args[0], scope, module, guard, record)
            if isinstance(target, (Ref, Instance)):
                return Untyped("dynamic getattr")
            return None
        callee = self._eval(node.func, scope, module, guard, record)
        shape = dict(
            positional=sum(1 for a in node.args if not isinstance(a, ast.Starred)),
            keywords=tuple(k.arg for k in node.keywords if k.arg is not None),
            star=any(isinstance(a, ast.Starred) for a in node.args),
            double_star=any(k.arg is None for k in node.keywords),
        )
        if isinstance(callee, CallerClass):
            library_bases = self._library_bases(callee)
            if library_bases and not self._caller_defines(callee, "__init__") and record:
                self._site("call", module, node, Ref(library_bases[0]), guard, receiver="function", **shape)
            return callee if not library_bases else Instance(library_bases[0])
        if isinstance(callee, Untyped):
            if record:
                self._site("call", module, node, None, guard, unverified=callee.reason, **shape)
            return Untyped(callee.reason)
        if isinstance(callee, Ref):
            if record:
                self._site("call", module, node, callee, guard, receiver="function", **shape)
            return self.returns_of(callee.path)
        if isinstance(callee, _Bound):
            if record:
                self._site(
                    "call", module, node, Ref(callee.class_path), guard, receiver="bound", member=callee.member, **shape
                )
            return self.returns_of(f"{callee.class_path}.{callee.member}")
        return None

    def _library_bases(self, cls: CallerClass) -> tuple[str, ...]:
        if cls.library_bases:
            return cls.library_bases
        module = self.modules.get(cls.module)
        found = module.scope.get(cls.name) if module else None
        return found.library_bases if isinstance(found, CallerClass) else ()

    def _caller_defines(self, cls: CallerClass, name: str) -> bool:
        module = self.modules.get(cls.module)
        if module is None:
            return False
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ClassDef) and node.name == cls.name:
                if name == "__init__" and any(_makes_init(d) for d in node.decorator_list):
                    return True
                return any(isinstance(i, (ast.FunctionDef, ast.AsyncFunctionDef)) and i.name == name for i in node.body)
        return False

    def _site(
        self,
        kind: str,
        module: CallerModule,
        node: ast.AST,
        callee: Value,
        guard: str | None,
        receiver: str = "function",
        member: str | None = None,
        unverified: str | None = None,
        signature: Signature | None = None,
        defines: tuple[str, ...] = (),
        **shape,
    ) -> None:
        text = ast.get_source_segment(module.source, node) or ""
        self.sites.append(
            Site(
                kind,
                module.path,
                node.lineno,
                callee,
                receiver,
                member,
                guard=guard,
                text=text.splitlines()[0][:120] if text else "",
                unverified=unverified,
                signature=signature,
                defines=defines,
                **shape,
            )
        )


@dataclass(frozen=True)
class _Super:
    """``super()`` inside a method of a caller class."""

    cls: CallerClass


@dataclass(frozen=True)
class _Bound:
    """``instance.member`` where the instance's class is a library class."""

    class_path: str
    member: str


def assigned_targets(node: ast.AST) -> list[ast.expr]:
    """What an assignment statement (``x = ...``, ``x: T = ...``) assigns to; empty for any other node."""
    if isinstance(node, ast.Assign):
        return list(node.targets)
    return [node.target] if isinstance(node, ast.AnnAssign) else []


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, including those inside top-level try/if blocks."""
    for node in body:
        if isinstance(node, ast.Try):
            yield from _top_level(node.body)
            for handler in node.handlers:
                yield from _top_level(handler.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        else:
            yield node


def _exception_names(handler: ast.ExceptHandler) -> set[str]:
    if handler.type is None:
        return {"BaseException"}
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return {_last_name(t) for t in types}


def _last_name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _is_version_check(test: ast.expr) -> bool:
    """``if lib.__version__ >= ...``, ``if Version(x) < ...``, ``if sys.version_info ...``, ``hasattr(...)``."""
    for node in ast.walk(test):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
        if "version" in name.lower():
            return True
        if isinstance(node, ast.Call) and _last_name(node.func) == "hasattr":
            return True
    return False


def _makes_init(decorator: ast.expr) -> bool:
    """``@dataclass`` / ``@dataclasses.dataclass(...)`` writes the class's own ``__init__`` (unless ``init=False``)."""
    call = decorator if isinstance(decorator, ast.Call) else None
    name = call.func if call is not None else decorator
    named = (isinstance(name, ast.Name) and name.id == "dataclass") or (
        isinstance(name, ast.Attribute) and name.attr == "dataclass"
    )
    no_init = call is not None and any(
        k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False for k in call.keywords
    )
    return named and not no_init


def _own_signature(function: ast.FunctionDef | ast.AsyncFunctionDef) -> Signature:
    """A method's parameters as the library sees them when it calls the method (``self``/``cls`` given; none for a
    staticmethod)."""
    arguments = function.args
    positional = [(a, Kind.POSITIONAL_ONLY) for a in arguments.posonlyargs]
    positional += [(a, Kind.POSITIONAL_OR_KEYWORD) for a in arguments.args]
    defaults = len(arguments.defaults)
    params = [Param(a.arg, kind, index >= len(positional) - defaults) for index, (a, kind) in enumerate(positional)]
    if arguments.vararg:
        params.append(Param(arguments.vararg.arg, Kind.VAR_POSITIONAL, True))
    params += [
        Param(a.arg, Kind.KEYWORD_ONLY, default is not None)
        for a, default in zip(arguments.kwonlyargs, arguments.kw_defaults)
    ]
    if arguments.kwarg:
        params.append(Param(arguments.kwarg.arg, Kind.VAR_KEYWORD, True))
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in function.decorator_list)
    signature = Signature(tuple(params))
    return signature if static else signature.drop_first()
