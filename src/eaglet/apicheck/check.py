"""Bind every call site into the library against the library's signatures; report only what will break."""

from __future__ import annotations

import dataclasses
import re
import sys
import sysconfig
import tempfile
import time
import zipfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import griffe

from ..errors import EagletError
from .callsites import Analyzer, Instance, Ref, Site, Untyped, discover
from .library import Constructor, Library, Resolved
from .signature import CallShape, Kind, bind

MAX_UNVERIFIED_EXAMPLES = 3


@dataclass
class Finding:
    level: str  # "error" or "warning"
    path: str
    line: int
    target: str  # the library's qualified name
    message: str
    defined_at: str = ""
    version: str = ""
    code: str = ""

    def key(self) -> tuple[str, int, str, str]:
        return self.path, self.line, self.target, self.message


@dataclass
class Report:
    package: str
    version: str
    source: str
    findings: list[Finding] = field(default_factory=list)
    call_sites: int = 0
    imports: int = 0
    overrides: int = 0  # the caller's methods the library calls (they override a library class's)
    unverified: Counter = field(default_factory=Counter)
    unverified_examples: dict[str, list[str]] = field(default_factory=dict)
    seconds: float = 0.0
    sources: list[Path] = field(default_factory=list)  # the library's files the check read

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "warning"]

    def as_json(self) -> dict[str, Any]:
        return {
            "package": self.package,
            "version": self.version,
            "source": self.source,
            "call_sites": self.call_sites,
            "imports": self.imports,
            "overrides": self.overrides,
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "findings": [asdict(f) for f in self.findings],
            "unverified": {
                "total": sum(self.unverified.values()),
                "by_reason": dict(self.unverified),
                "examples": self.unverified_examples,
            },
            "seconds": round(self.seconds, 3),
        }


def library_roots(
    package: str, site_packages: Path | None = None, wheel: Path | None = None, scratch: Path | None = None
) -> tuple[list[Path], str]:
    """Where the library's sources are: an unpacked wheel, a given directory, or this interpreter's site."""
    if wheel is not None:
        if not wheel.is_file():
            raise EagletError(f"{wheel}: no such wheel; pass the path of a .whl file")
        target = Path(tempfile.mkdtemp(prefix="eaglet-wheel-", dir=scratch))
        try:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(target)
        except zipfile.BadZipFile:
            raise EagletError(f"{wheel}: not a wheel (bad zip file); download it again") from None
        return [target], str(wheel)
    if site_packages is not None:
        if not site_packages.is_dir():
            raise EagletError(
                f"{site_packages}: not a directory; pass the site-packages (or source) directory holding {package}"
            )
        return [site_packages], str(site_packages)
    roots = [  # in the order `import` searches them (site-packages last too, should sys.path lack it)
        Path(p)
        for p in dict.fromkeys([*sys.path, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
        if p and Path(p).is_dir()
    ]
    return roots, "installed"


def check_calls(paths: list[Path], package: str, roots: list[Path], source: str) -> Report:
    started = time.perf_counter()
    for path in paths:
        if not path.exists():
            raise EagletError(f"{path}: no such file or directory; pass the code to check")
    library = Library(package, roots)
    if library.module(package) is None:
        raise EagletError(f"{package}: not found in {source}; install it, or pass --site-packages DIR or --wheel FILE")
    analyzer = Analyzer(
        package, discover(paths), lambda module: _exports(library, module), lambda path: _returns(library, path)
    )
    sites = analyzer.run()
    report = Report(package, library.version, source)
    for site in sites:
        if site.kind == "import":
            report.imports += 1
            _check_import(library, site, report)
        elif site.kind == "subclass":
            _check_abstract(library, site, report)
        elif site.kind == "override":
            report.overrides += 1
            _check_override(library, site, report)
        else:
            report.call_sites += 1
            _check_call(library, site, report)
    report.findings.sort(key=lambda f: (f.path, f.line, f.target))
    report.sources = library.files_read()
    report.seconds = time.perf_counter() - started
    return report


def upgrade_report(old: Report, new: Report) -> Report:
    """Only what the upgrade changes: findings of the new version that the old one did not have."""
    before = {(f.path, f.line, f.target, f.level) for f in old.findings}
    changed = Report(
        new.package,
        f"{old.version} -> {new.version}",
        f"{old.source} -> {new.source}",
        [f for f in new.findings if (f.path, f.line, f.target, f.level) not in before],
        new.call_sites,
        new.imports,
        new.overrides,
        new.unverified,
        new.unverified_examples,
        old.seconds + new.seconds,
    )
    return changed


# ---------------------------------------------------------------------------------------------


def _exports(library: Library, module_path: str) -> list[str] | None:
    names = library._wildcard_exports(module_path)
    return sorted(names) if names is not None else None


def _returns(library: Library, path: str) -> Any:
    """What calling ``path`` gives: an instance of a library class when the annotation says so."""
    resolved = library.resolve(path)
    if not resolved.found:
        return None
    obj = resolved.obj
    if isinstance(obj, griffe.Class):
        return Instance(resolved.path)
    if isinstance(obj, griffe.Function):
        returns = obj.returns
        if returns is None:
            return Untyped(f"return value of {resolved.path} has no annotation")
        expr = returns.left if isinstance(returns, griffe.ExprSubscript) else returns
        target = getattr(expr, "canonical_path", None)
        if target in ("typing.Self", "typing_extensions.Self") or str(returns) in ("Self", "'Self'"):
            return Instance(path.rsplit(".", 1)[0])  # the class it was called on, not the one defining it
        if target and library.inside(target):
            found = library.resolve(target)
            if found.found and isinstance(found.obj, griffe.Class):
                return Instance(found.path)
        return None
    return None


def _location(resolved: Resolved) -> str:
    obj = resolved.obj
    if obj is None or not hasattr(obj, "filepath"):
        return ""
    filepath = obj.filepath if not isinstance(obj.filepath, list) else obj.filepath[0]
    return f"{filepath}:{obj.lineno}"


def _add(report: Report, site: Site, level: str, target: str, message: str, defined_at: str = "") -> None:
    if level == "error" and site.guard:
        level, message = (
            "warning",
            f"{message} (guarded by {'an ' + site.guard if site.guard.startswith('Import') else 'a ' + site.guard})",
        )
    report.findings.append(
        Finding(level, str(site.path), site.line, target, message, defined_at, report.version, site.text)
    )


def _unverified(report: Report, site: Site, reason: str) -> None:
    general = re.sub(r"'[^']*'", "X", reason)  # "module X defines __getattr__": one tally per kind of reason
    report.unverified[general] += 1
    examples = report.unverified_examples.setdefault(general, [])
    if len(examples) < MAX_UNVERIFIED_EXAMPLES:
        examples.append(f"{site.path}:{site.line}")


def _check_import(library: Library, site: Site, report: Report) -> None:
    assert isinstance(site.callee, Ref)
    resolved = library.resolve(site.callee.path)
    if resolved.status == "missing":
        _add(
            report,
            site,
            "error",
            site.callee.path,
            f"import of a name {library.package} {report.version} no longer has: {resolved.reason}",
        )
    elif resolved.status == "unverified":
        _unverified(report, site, resolved.reason)


def _check_call(library: Library, site: Site, report: Report) -> None:
    if site.unverified or site.callee is None:
        _unverified(report, site, site.unverified or "untyped value")
        return
    assert isinstance(site.callee, Ref)
    if site.receiver == "bound" and site.member == "__init__":  # super().__init__(...): the base's constructor
        site = dataclasses.replace(site, receiver="function", member=None)
    path = site.callee.path if site.receiver != "bound" else f"{site.callee.path}.{site.member}"
    resolved = library.resolve(path)
    if resolved.status == "missing":
        _add(
            report,
            site,
            "error",
            path,
            f"{path} does not exist in {library.package} {report.version}: {resolved.reason}",
        )
        return
    if resolved.status == "unverified":
        _unverified(report, site, resolved.reason)
        return
    obj = resolved.obj
    shape = CallShape(site.positional, site.keywords, site.star, site.double_star)
    if isinstance(obj, griffe.Class):  # Class(...), module.Class(...) or instance.NestedClass(...)
        constructor = library.constructor(obj, resolved.path)
        if isinstance(constructor, Resolved):
            _unverified(report, site, constructor.reason)
            return
        _bind(report, site, constructor, shape)
        return
    if isinstance(obj, griffe.Function):
        labels = obj.labels
        if "property" in labels or any(str(d.value).endswith(("property", "cached_property")) for d in obj.decorators):
            _unverified(report, site, "calls the value of a property")
            return
        signatures = library.function_signatures(obj)
        bound_by_instance = site.receiver == "bound" and "staticmethod" not in labels
        bound_by_class = site.receiver != "bound" and "classmethod" in labels and _is_method(obj)
        if bound_by_instance or bound_by_class:
            signatures = [s.drop_first() for s in signatures]
        called = Constructor(signatures, _location(resolved), resolved.path, library.keyword_forwarding(obj))
        _bind(report, site, called, shape)
        return
    _unverified(report, site, "calls a value (attribute or module), not a function or class")


def _library_class(library: Library, site: Site) -> Resolved | None:
    """The library base of a caller class, when it resolves to a class."""
    assert isinstance(site.callee, Ref)
    resolved = library.resolve(site.callee.path)
    return resolved if resolved.found and isinstance(resolved.obj, griffe.Class) else None


def _check_abstract(library: Library, site: Site, report: Report) -> None:
    """Every abstract method of the library base is defined by the caller's class, or creating it raises."""
    base = _library_class(library, site)
    if base is None:
        return  # a missing base is the import's finding
    abstract: set[str] = set()
    settled: set[str] = set()
    for _, owner in library.mro(base.obj, base.path):
        for name, member in owner.members.items() if owner is not None else []:
            if name in settled:
                continue
            settled.add(name)
            if isinstance(member, griffe.Function) and "abstractmethod" in member.labels:
                abstract.add(name)
    for name in sorted(abstract - set(site.defines)):
        _add(
            report,
            site,
            "error",
            f"{base.path}.{name}",
            f"{name} is abstract in {base.path} ({library.package} {report.version}) and this class does not define "
            "it: creating it raises TypeError",
            _location(library.class_member(base.obj, base.path, name) or base),
        )


def _check_override(library: Library, site: Site, report: Report) -> None:
    """The library calls the caller's method as it calls the base's: the override must take that call."""
    base = _library_class(library, site)
    if base is None or site.signature is None or site.member is None:
        return
    resolved = library.class_member(base.obj, base.path, site.member)
    if resolved is None or not resolved.found or not isinstance(resolved.obj, griffe.Function):
        return  # the caller's own method, not an override
    function = resolved.obj
    if "property" in function.labels:
        return
    called = library.function_signatures(function)[-1]
    if "staticmethod" not in function.labels:
        called = called.drop_first()
    if any(p.kind in (Kind.VAR_POSITIONAL, Kind.VAR_KEYWORD) for p in called.params):
        return  # the base takes anything (nn.Module.forward(*input)): its signature does not say how it is called
    by_position = [p for p in called.params if p.kind in (Kind.POSITIONAL_ONLY, Kind.POSITIONAL_OR_KEYWORD)]
    keyword_only = tuple(p.name for p in called.params if p.kind is Kind.KEYWORD_ONLY)
    shown = ", ".join(p.name for p in called.params)
    problems = [p for p in bind(site.signature, CallShape(len(by_position), keyword_only)) if p.level == "error"]
    if problems:
        _add(
            report,
            site,
            "error",
            resolved.path,
            f"{library.package} {report.version} calls {site.member}({shown}) as {resolved.path} declares it; this "
            f"override cannot take that call: {'; '.join(p.message for p in problems)}",
            _location(resolved),
        )
        return
    named = [p.name for p in by_position if p.kind is Kind.POSITIONAL_OR_KEYWORD]
    positional_only = sum(p.kind is Kind.POSITIONAL_ONLY for p in by_position)
    by_name = [
        p for p in bind(site.signature, CallShape(positional_only, (*named, *keyword_only))) if p.level == "error"
    ]
    if by_name:
        _add(
            report,
            site,
            "warning",
            resolved.path,
            f"this override names the parameters of {resolved.path}({shown}) differently: a call by name fails "
            f"({'; '.join(p.message for p in by_name)})",
            _location(resolved),
        )


def _onward(callable_: Constructor) -> Constructor:
    """The callable ``callable_`` passes its ``**kwargs`` to, named as reached through it."""
    onward = callable_.forwards_to
    assert onward is not None
    return dataclasses.replace(onward, qualname=f"{onward.qualname} (through {callable_.qualname}'s **kwargs)")


def _is_method(function: Any) -> bool:
    return isinstance(function.parent, griffe.Class)


def _bind(report: Report, site: Site, callable_: Constructor, shape: CallShape) -> None:
    outcomes = [bind(signature, shape) for signature in callable_.signatures]
    clean = [o for o in outcomes if not any(p.level == "error" for p in o)]
    if clean:
        for problem in clean[0]:  # warnings of a binding that works (e.g. keyword silently ignored)
            _add(report, site, problem.level, callable_.qualname, problem.message, callable_.defined_at)
        signature = callable_.signatures[outcomes.index(clean[0])]
        passed_on = [k for k in shape.keywords if k not in signature.named]
        if passed_on and callable_.forwards_to is not None:  # the **kwargs the callable hands on bind there
            onward = CallShape(0, tuple(passed_on), double_star=True)  # the rest of its arguments are the callable's
            _bind(report, site, _onward(callable_), onward)
        return
    problems = outcomes[0]
    message = "; ".join(p.message for p in problems if p.level == "error")
    if len(outcomes) > 1:
        message = f"no overload accepts this call (first: {message})"
    _add(report, site, "error", callable_.qualname, message, callable_.defined_at)
