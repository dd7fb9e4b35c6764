"""A library read from its source (or stubs) without importing it: griffe parses each module on demand,
and names are resolved here, lazily, so checking 50 calls into a 2,000-module package reads a few dozen.

Resolution follows what Python would do at import time: module members, import aliases and re-exports,
``from x import *`` (with or without ``__all__``), submodules, class members through the C3 MRO. Names it
cannot follow for certain come back as *unverified* with the reason, never as a guess.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import griffe

from .signature import Kind, Param, Signature

MAX_ALIAS_HOPS = 40  # re-export chains longer than this are treated as cycles
MAX_FORWARDING_DEPTH = 4  # **kwargs followed through at most this many functions
DATACLASS_DECORATORS = {"dataclasses.dataclass"}
PYDANTIC_DATACLASS_DECORATORS = {"pydantic.dataclasses.dataclass"}
# decorators known to hand back the class they decorate (a library's own are read: see _returns_its_argument)
TRANSPARENT_DECORATORS = {
    "functools.total_ordering",
    "typing.final",
    "typing_extensions.final",
    "typing.runtime_checkable",
    "typing_extensions.runtime_checkable",
    "enum.unique",
    "typing.no_type_check",
}
ATTRS_DECORATORS = {
    "attr.s",
    "attr.attrs",
    "attr.define",
    "attr.frozen",
    "attr.mutable",
    "attr.dataclass",
    "attrs.define",
    "attrs.frozen",
    "attrs.mutable",
}
ATTRS_FIELD_CALLS = {"attr.ib", "attr.attrib", "attr.field", "attrs.field"}
DATACLASS_TRANSFORM = {"typing.dataclass_transform", "typing_extensions.dataclass_transform"}
PYDANTIC_BASES = {"pydantic.BaseModel", "pydantic.main.BaseModel"}
MSGSPEC_BASES = {"msgspec.Struct"}
SIGNATURE_KEEPING = {"property", "functools.cached_property", "builtins.property"}  # not calls: attribute access
COMPILED_SUFFIXES = (".so", ".pyd")
VERSION_MODULES = ("", "version", "_version", "__about__")  # where packages keep their version ("" = __init__)
UNVERIFIED = "unverified"  # a family: the class's constructor cannot be known statically
PYDANTIC_DATACLASS = "pydantic-dataclass"
STAR_IMPORT = re.compile(r"^\s*from\s+(\.*)([\w.]*)\s+import\s+\*", re.MULTILINE)


@dataclass
class Resolved:
    """What a dotted path names in the library."""

    status: str  # "found", "missing", "unverified"
    path: str
    obj: Any = None  # the griffe object when found
    reason: str = ""

    @property
    def found(self) -> bool:
        return self.status == "found"


@dataclass
class Constructor:
    signatures: list[Signature]
    defined_at: str  # "path:line" of the __init__ (or of the class whose fields generate it)
    qualname: str
    # where keywords its signature's ``**kwargs`` takes go on to: the one callable of the library its body passes
    # ``**kwargs`` to (vLLM's ``LLM(**kwargs)`` -> ``EngineArgs(**kwargs)``), whose signature then binds them
    forwards_to: "Constructor | None" = None


@dataclass
class Library:
    package: str
    roots: list[Path]
    modules: dict[str, Any] = field(default_factory=dict)  # module name -> griffe Module | "compiled" | None
    texts: dict[str, str | None] = field(default_factory=dict)  # module name -> source text (None: unreadable)
    exports: dict[str, set[str] | None] = field(default_factory=dict)  # module name -> names `import *` binds
    star_bindings: dict[tuple[str, str], Any] = field(default_factory=dict)  # (module, name) -> _star_binding's answer
    package_roots: dict[str, list[Path]] = field(default_factory=dict)  # top-level name -> the roots it imports from

    @property
    def version(self) -> str:
        """The distribution's version from its dist-info next to the sources, else the string the package's own
        version module assigns (``__init__``, ``version``, ``_version``, ``__about__``: vLLM, torch and setuptools-scm
        packages keep it there)."""
        wanted = re.sub(r"[-_.]+", "_", self.package).lower()
        for root in self.roots:
            for info in sorted(root.glob("*.dist-info")):
                name, _, rest = info.name[: -len(".dist-info")].partition("-")
                if re.sub(r"[-_.]+", "_", name).lower() == wanted and rest:
                    return rest
        for module in VERSION_MODULES:
            text = self._text(self.package if not module else f"{self.package}.{module}")
            version = _assigned_version(text) if text else None
            if version:
                return version
        return "unknown"

    # ------------------------------------------------------------------ modules

    def _package_roots(self, top: str) -> list[Path]:
        """The roots `import top` reads, as Python's path finder picks them: the first root holding a regular package
        or a module of that name (its submodules come from there alone, whatever later roots hold), else every root
        holding a namespace portion of it."""
        if top not in self.package_roots:
            portions: list[Path] = []
            for root in self.roots:
                base = root / top
                regular = any((base / init).is_file() for init in ("__init__.py", "__init__.pyi"))
                module = any(base.with_suffix(suffix).is_file() for suffix in (".py", ".pyi")) or any(
                    p.name.startswith(top + ".") and p.suffix in COMPILED_SUFFIXES for p in root.iterdir()
                )
                if regular or module:
                    portions = [root]
                    break
                if base.is_dir():
                    portions.append(root)
            self.package_roots[top] = portions
        return self.package_roots[top]

    def _file(self, name: str) -> Path | str | None:
        relative = Path(*name.split("."))
        for root in self._package_roots(name.split(".")[0]):
            base = root / relative
            for candidate in (
                base / "__init__.pyi",
                base / "__init__.py",
                base.with_suffix(".pyi"),
                base.with_suffix(".py"),
            ):
                if candidate.is_file():
                    return candidate
            if base.parent.is_dir() and any(
                p.name.startswith(base.name + ".") and p.suffix in COMPILED_SUFFIXES for p in base.parent.iterdir()
            ):
                return "compiled"
        return None

    def module(self, name: str) -> Any:
        """The griffe module, "compiled" (a binary without stubs) or None (no such module). A submodule is read
        under its parent package, so griffe resolves its relative imports against the package (without the parent,
        ``from .state import x`` in ``pkg.comm`` reads as ``pkg.comm.state.x``)."""
        if name not in self.modules:
            file = self._file(name)
            if isinstance(file, Path):
                package, _, short = name.rpartition(".")
                parent = self.module(package) if package else None
                code = file.read_text(encoding="utf-8", errors="replace")
                if isinstance(parent, griffe.Module):
                    self.modules[name] = griffe.visit(short, filepath=file, code=code, parent=parent)
                else:
                    self.modules[name] = griffe.visit(name, filepath=file, code=code)
            else:
                self.modules[name] = file
        return self.modules[name]

    # ------------------------------------------------------------------ names

    def inside(self, path: str) -> bool:
        return path == self.package or path.startswith(self.package + ".")

    def resolve(self, path: str, hops: int = 0) -> Resolved:
        """The object a dotted path names, following aliases, re-exports, submodules and inheritance."""
        if hops > MAX_ALIAS_HOPS:
            return Resolved("unverified", path, reason="alias chain too long (a cycle?)")
        if not self.inside(path):
            return Resolved("unverified", path, reason=f"defined outside {self.package}")
        parts = path.split(".")
        current_path = parts[0]
        current = self.module(current_path)
        if current is None:
            return Resolved("missing", path, reason=f"module '{current_path}' not found")
        for index, part in enumerate(parts[1:], start=1):
            if current == "compiled":
                return Resolved("unverified", path, reason=f"compiled module '{current_path}' without stubs")
            rest = ".".join(parts[index + 1 :])
            step = self._member(current, current_path, part, hops)
            if step.status == "missing":
                return Resolved("missing", path, reason=step.reason)
            if step.status != "found":
                return step
            if step.obj == "module":
                current_path = step.path
                current = self.module(current_path)
                continue
            if getattr(step.obj, "is_alias", False):
                return self.resolve(step.obj.target_path + (f".{rest}" if rest else ""), hops + 1)
            current, current_path = step.obj, step.path
        if current == "compiled":
            return Resolved("unverified", path, reason=f"compiled module '{current_path}' without stubs")
        return Resolved("found", current_path, current)

    def _member(self, owner: Any, owner_path: str, name: str, hops: int) -> Resolved:
        if isinstance(owner, griffe.Module):
            member = _member_or_stub_overload(owner, name)
            if member is not None and member.is_alias and "/" in member.name:
                member = None
            # Python binds names in statement order: a star import below the name's own binding rebinds it
            explicit_line = _line(member) if member is not None else -1
            if member is None and (owner.is_package or owner.filepath.name.startswith("__init__")):
                submodule = f"{owner_path}.{name}"  # `import pkg.sub` binds pkg.sub whatever pkg star-imports
                if self.module(submodule) is not None:
                    return Resolved("found", submodule, "module")
            wildcards = [m for m in owner.members.values() if m.is_alias and m.name.endswith("/*")]
            for wildcard in sorted(wildcards, key=_line, reverse=True):
                if _line(wildcard) < explicit_line:
                    break
                if member is not None and not self._mentions(wildcard.target_path, name):
                    continue  # below a definition only a module naming it itself rebinds it (spares deep chains)
                found = self._star_binding(wildcard.target_path, name, hops)
                if found is not None and not (found.status == "unverified" and member is not None):
                    return found  # a compiled module star-imported below a definition is taken not to rebind it

            if member is not None:
                return Resolved("found", f"{owner_path}.{name}", member)
            if "__getattr__" in owner.members:
                return Resolved(
                    "unverified",
                    f"{owner_path}.{name}",
                    reason=f"module '{owner_path}' defines __getattr__ (dynamic names)",
                )
            return Resolved(
                "missing", f"{owner_path}.{name}", reason=f"module '{owner_path}' has no attribute '{name}'"
            )
        if isinstance(owner, griffe.Class):
            found = self.class_member(owner, owner_path, name)
            if found is not None:
                return found
            return Resolved("missing", f"{owner_path}.{name}", reason=f"class '{owner_path}' has no attribute '{name}'")
        return Resolved("unverified", f"{owner_path}.{name}", reason="attribute of a value whose type is not known")

    def _star_binding(self, source: str, name: str, hops: int) -> Resolved | None:
        """What ``from source import *`` binds to ``name`` (None: it binds nothing of that name). Without ``__all__``
        the star import binds every public name of ``source``, those it imported included. Remembered per (source,
        name): packages star-import the same modules along many chains."""
        key = (source, name)
        if key not in self.star_bindings:
            self.star_bindings[key] = None  # a star-import cycle binds nothing more
            self.star_bindings[key] = self._read_star_binding(source, name, hops)
        return self.star_bindings[key]

    def _read_star_binding(self, source: str, name: str, hops: int) -> Resolved | None:
        if not self._may_define(source, name, set()):
            return None
        source_module = self.module(source)
        if source_module in (None, "compiled"):
            return Resolved("unverified", name, reason=f"'from {source} import *' of a module it cannot read")
        exports = None if source_module.exports is None else {str(e).strip("'\"") for e in source_module.exports}
        if (exports is not None and name not in exports) or (exports is None and name.startswith("_")):
            return None
        found = self._member(source_module, source, name, hops + 1)
        return None if found.status == "missing" else found

    def _mentions(self, module_path: str, name: str) -> bool:
        text = self._text(module_path) if self.inside(module_path) else None
        return text is not None and re.search(rf"\b{re.escape(name)}\b", text) is not None

    def files_read(self) -> list[Path]:
        """Every source file of the library this check has read (parsed or only scanned as text)."""
        parsed = {Path(m.filepath) for m in self.modules.values() if hasattr(m, "filepath")}
        scanned = {self._file(name) for name, text in self.texts.items() if text is not None}
        return sorted(parsed | {f for f in scanned if isinstance(f, Path)})

    def _text(self, name: str) -> str | None:
        if name not in self.texts:
            file = self._file(name)
            self.texts[name] = file.read_text(encoding="utf-8", errors="replace") if isinstance(file, Path) else None
        return self.texts[name]

    def _may_define(self, module_path: str, name: str, seen: set[str]) -> bool:
        """A text-only pre-filter: can ``module_path`` (or what it star-imports) bind ``name``? Spares parsing
        the hundreds of modules a package like transformers star-imports when the name is elsewhere."""
        if module_path in seen or not self.inside(module_path):
            return module_path not in seen
        seen.add(module_path)
        text = self._text(module_path)
        if text is None:
            return True
        listed = _literal_all(text)
        if listed is not None:  # `import *` of a module with a literal __all__ binds exactly those names
            return name in listed
        if re.search(rf"\b{re.escape(name)}\b", text):
            return True
        file = self._file(module_path)
        package = module_path if isinstance(file, Path) and file.stem == "__init__" else module_path.rsplit(".", 1)[0]
        for dots, target in STAR_IMPORT.findall(text):
            base = package.split(".")
            if dots:
                base = base[: len(base) - (len(dots) - 1)]
                source = ".".join(base + ([target] if target else []))
            else:
                source = target
            if self._may_define(source, name, seen):
                return True
        return False

    def _wildcard_exports(self, module_path: str) -> set[str] | None:
        if module_path not in self.exports:
            self.exports[module_path] = None  # a cycle reads as "nothing more"
            self.exports[module_path] = self._compute_exports(module_path)
        return self.exports[module_path]

    def _compute_exports(self, module_path: str) -> set[str] | None:
        module = self.module(module_path)
        if module in (None, "compiled"):
            return None
        if module.exports is not None:
            return {str(e).strip("'\"") for e in module.exports}
        names = {n for n in module.members if not n.startswith("_") and "/" not in n}
        for wildcard in [m for m in module.members.values() if m.is_alias and m.name.endswith("/*")]:
            nested = self._wildcard_exports(wildcard.target_path) if self.inside(wildcard.target_path) else None
            names |= nested or set()
        return names

    # ------------------------------------------------------------------ classes

    def base_paths(self, cls: Any) -> list[str]:
        paths = []
        for base in cls.bases:
            expr = base.left if isinstance(base, griffe.ExprSubscript) else base
            paths.append(getattr(expr, "canonical_path", str(expr)))
        return paths

    def mro(self, cls: Any, path: str, seen: frozenset[str] = frozenset()) -> list[tuple[str, Any]]:
        """C3 linearisation; classes outside the library appear as (path, None)."""
        if path in seen:
            return [(path, cls)]
        linearised = []
        for base_path in self.base_paths(cls):
            resolved = self.resolve(base_path) if self.inside(base_path) else Resolved("unverified", base_path)
            if resolved.found and isinstance(resolved.obj, griffe.Class):
                linearised.append(self.mro(resolved.obj, resolved.path, seen | {path}))
            else:
                linearised.append([(base_path, None)])
        return [(path, cls)] + _c3_merge(linearised, [bases[0] for bases in linearised])

    def class_member(self, cls: Any, path: str, name: str) -> Resolved | None:
        """``name`` looked up along the MRO; unverified when a class answers unknown names at run time
        (``__getattr__``, e.g. torch.nn.Module's submodules and parameters)."""
        mro = self.mro(cls, path)
        found = self._class_member(mro, path, name)
        if found is None and name != "__getattr__":
            dynamic = next((p for p, c in mro if c is not None and "__getattr__" in c.members), None)
            if dynamic is not None:
                return Resolved(
                    "unverified", f"{path}.{name}", reason=f"class '{dynamic}' defines __getattr__ (dynamic attributes)"
                )
        return found

    def _class_member(self, mro: list[tuple[str, Any]], path: str, name: str) -> Resolved | None:
        for owner_path, owner in mro:
            if owner is None:
                if owner_path not in ("object", "builtins.object", "typing.Generic", "typing.Protocol", "abc.ABC"):
                    return Resolved(
                        "unverified",
                        f"{path}.{name}",
                        reason=f"may come from base '{owner_path}' outside {self.package}",
                    )
                continue
            member = _member_or_stub_overload(owner, name)
            if member is not None:
                if member.is_alias:
                    return self.resolve(member.target_path)
                return Resolved("found", f"{owner_path}.{name}", member)
        return None

    def constructor(self, cls: Any, path: str) -> Constructor | Resolved:
        """How calling the class binds: the first __init__ (explicit or generated) along the MRO."""
        for owner_path, owner in self.mro(cls, path):
            if owner is None:
                if owner_path in PYDANTIC_BASES or owner_path in MSGSPEC_BASES:
                    break  # the generated __init__ of the first class below it, built from fields
                if owner_path in ("object", "builtins.object", "typing.Generic", "abc.ABC", "typing.Protocol"):
                    continue
                return Resolved(
                    "unverified", path, reason=f"constructor may come from base '{owner_path}' outside {self.package}"
                )
            for special in ("__init__", "__new__"):
                member = _member_or_stub_overload(owner, special)
                if isinstance(member, griffe.Function):
                    return Constructor(
                        [s.drop_first() for s in self.function_signatures(member)],
                        f"{owner.filepath}:{member.lineno}",
                        f"{owner_path}.{special}",
                        self.keyword_forwarding(member),
                    )
            generated = self.generated_init(owner, owner_path)
            if generated is not None:
                return generated
        generated = self.generated_init(cls, path)
        if generated is not None:
            return generated
        return Constructor([Signature(())], f"{cls.filepath}:{cls.lineno}", f"{path} (object.__init__)")

    # ------------------------------------------------------------------ signatures

    def function_signatures(self, function: Any) -> list[Signature]:
        """One signature, or each overload's and the implementation's (a call is fine if any binds: at run time
        Python binds the implementation, whatever the overloads declare)."""
        overloads = list(getattr(function, "overloads", None) or [])
        if overloads:
            overloads.append(function)  # the implementation the overloads describe
        elif function.parent is not None:  # one of a stub's overloads (no implementation)
            siblings = getattr(function.parent, "overloads", {}).get(function.name) or []
            overloads = siblings if function in siblings else []
        functions = overloads or [function]
        return [
            Signature(tuple(Param(p.name, Kind(p.kind.value), p.default is not None) for p in f.parameters))
            for f in functions
        ]

    def generated_init(self, cls: Any, path: str) -> Constructor | Resolved | None:
        """The ``__init__`` a dataclass-like decorator or base generates from the class's fields (unverified when a
        decorator may replace the class)."""
        family, options = self._dataclass_family(cls, path)
        if family == UNVERIFIED:
            return Resolved("unverified", path, reason=options["reason"])
        if family is None or options.get("init") is False:
            return None
        fields: dict[str, Param] = {}
        ignores = False
        chain = [(p, c) for p, c in reversed(self.mro(cls, path)) if c is not None]
        for owner_path, owner in chain:
            owner_family, owner_options = self._dataclass_family(owner, owner_path)
            if owner_family != family:
                continue
            kw_only = bool(owner_options.get("kw_only")) or family == "pydantic"
            for name, member in owner.members.items():
                if member.is_alias or not isinstance(member, griffe.Attribute) or member.annotation is None:
                    continue
                if "instance-attribute" not in member.labels:  # ClassVar
                    continue
                annotation = str(member.annotation)
                if family == "dataclass" and annotation.split("[")[0].endswith("KW_ONLY"):
                    kw_only = True
                    continue
                param = self._field(family, name, member, kw_only)
                if param is not None:
                    fields[name] = param  # a redefinition keeps the field's first position, as dataclasses do
            if family == "pydantic":
                ignores = self._pydantic_extra(owner) or ignores
            elif family == PYDANTIC_DATACLASS:
                ignores = _extra_option(str(owner_options.get("config", ""))) or ignores
        params = [p for p in fields.values() if p.kind is not Kind.KEYWORD_ONLY]
        params += [p for p in fields.values() if p.kind is Kind.KEYWORD_ONLY]
        pydantic = family in ("pydantic", PYDANTIC_DATACLASS)  # extra="ignore" unless configured otherwise
        if pydantic and ignores == "allow":
            params.append(Param("extra", Kind.VAR_KEYWORD, True))
        signature = Signature(tuple(params), ignores_unknown_keywords=pydantic and ignores not in ("forbid", "allow"))
        return Constructor([signature], f"{cls.filepath}:{cls.lineno}", f"{path}.__init__ (generated by {family})")

    def _pydantic_extra(self, cls: Any) -> str | bool:
        config = cls.members.get("model_config")
        text = str(config.value) if isinstance(config, griffe.Attribute) and config.value is not None else ""
        inner = cls.members.get("Config")
        if isinstance(inner, griffe.Class) and "extra" in inner.members:
            text += f" extra={inner.members['extra'].value}"
        return _extra_option(text)

    def _field(self, family: str, name: str, member: Any, kw_only: bool) -> Param | None:
        value = member.value
        call = value if isinstance(value, griffe.ExprCall) else None
        call_path = getattr(call.function, "canonical_path", "") if call is not None else ""
        keywords = {a.name: str(a.value) for a in (call.arguments if call else []) if isinstance(a, griffe.ExprKeyword)}
        if family in ("dataclass", PYDANTIC_DATACLASS) and call_path in ("dataclasses.field",):
            if keywords.get("init") == "False":
                return None
            has_default = "default" in keywords or "default_factory" in keywords
            kw_only = keywords.get("kw_only", str(kw_only)) == "True"
        elif family == "attrs":
            if call_path in ATTRS_FIELD_CALLS:
                if keywords.get("init") == "False":
                    return None
                has_default = bool({"default", "factory"} & set(keywords))
                kw_only = keywords.get("kw_only", str(kw_only)) == "True"
            else:
                has_default = value is not None
            name = name.lstrip("_")
        elif family in ("pydantic", PYDANTIC_DATACLASS) and (family == "pydantic" or call_path.endswith("Field")):
            if name.startswith("_") or name == "model_config":
                return None
            if call is not None and call_path.endswith("Field"):
                positional = [a for a in call.arguments if not isinstance(a, griffe.ExprKeyword)]
                has_default = (bool(positional) and str(positional[0]) != "...") or bool(
                    {"default", "default_factory"} & set(keywords)
                )
                name = keywords.get("alias", repr(name)).strip("'\"")
            else:
                has_default = value is not None
        else:
            has_default = value is not None
        return Param(name, Kind.KEYWORD_ONLY if kw_only else Kind.POSITIONAL_OR_KEYWORD, has_default)

    def _dataclass_family(self, cls: Any, path: str) -> tuple[str | None, dict[str, Any]]:
        """What makes the class's ``__init__``: its decorators, applied bottom-up (a decorator that hands back the
        class changes nothing; one that may not makes the constructor ``UNVERIFIED``), then a base or metaclass."""
        family: str | None = None
        options: dict[str, Any] = {}
        for decorator in reversed(cls.decorators):
            expr = decorator.value
            call = expr if isinstance(expr, griffe.ExprCall) else None
            target = call.function if call is not None else expr
            target_path = getattr(target, "canonical_path", str(target))
            keywords = {
                a.name: str(a.value) == "True" if str(a.value) in ("True", "False") else str(a.value)
                for a in (call.arguments if call else [])
                if isinstance(a, griffe.ExprKeyword)
            }
            if target_path in DATACLASS_DECORATORS:
                family, options = "dataclass", keywords
            elif target_path in PYDANTIC_DATACLASS_DECORATORS:
                family, options = PYDANTIC_DATACLASS, keywords
            elif target_path in ATTRS_DECORATORS:
                family, options = "attrs", keywords
            elif target_path in TRANSPARENT_DECORATORS:
                continue
            elif (transform := self._transform_options(target_path)) is not None:  # PEP 681: before its body says
                family, options = "dataclass", {"kw_only": transform.get("kw_only_default", False)} | keywords
            elif not self._returns_its_argument(target_path):
                return UNVERIFIED, {"reason": f"decorated by '{target_path}', which may not return the class"}
        if family is not None:
            return family, options
        for owner_path, owner in self.mro(cls, path):
            if owner is None and owner_path in PYDANTIC_BASES:
                return "pydantic", {}
            if owner is None and owner_path in MSGSPEC_BASES:
                return "msgspec", {"kw_only": getattr(cls, "keywords", {}).get("kw_only") == "True"}
            if owner is None:
                continue
            metaclass = (getattr(owner, "keywords", {}) or {}).get("metaclass")
            declared = [owner] if owner is not cls else []  # a base class declared with dataclass_transform
            if metaclass is not None:
                found = self.resolve(getattr(metaclass, "canonical_path", str(metaclass)))
                declared += [found.obj] if found.found and isinstance(found.obj, griffe.Class) else []
            for declarer in declared:
                transform = _transform_keywords(declarer)
                if transform is not None:
                    class_kw = getattr(cls, "keywords", {}) or {}
                    kw_only = class_kw.get("kw_only", transform.get("kw_only_default", "False")) == "True"
                    return "dataclass", {"kw_only": kw_only}
        return None, {}

    def keyword_forwarding(self, function: Any, depth: int = 0) -> Constructor | None:
        """What a function with ``**kwargs`` passes them on to, when its body does so in calls of one callable of the
        library (found by name in the function's module); None when it passes them nowhere, to several callables, or
        to one that cannot be read."""
        variadic = next((p.name for p in function.parameters if p.kind.value == Kind.VAR_KEYWORD.value), None)
        node = self._function_node(function) if variadic is not None and depth < MAX_FORWARDING_DEPTH else None
        if node is None:
            return None
        targets = {
            ast.unparse(call.func)
            for call in ast.walk(node)
            if isinstance(call, ast.Call)
            and any(k.arg is None and isinstance(k.value, ast.Name) and k.value.id == variadic for k in call.keywords)
        }
        if len(targets) != 1:
            return None
        resolved = self.resolve(f"{function.module.path}.{targets.pop()}")
        if not resolved.found:
            return None
        if isinstance(resolved.obj, griffe.Class):
            built = self.constructor(resolved.obj, resolved.path)
            return built if isinstance(built, Constructor) else None
        if isinstance(resolved.obj, griffe.Function):
            return Constructor(
                self.function_signatures(resolved.obj),
                f"{resolved.obj.filepath}:{resolved.obj.lineno}",
                resolved.path,
                self.keyword_forwarding(resolved.obj, depth + 1),
            )
        return None

    def _function_node(self, function: Any) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        """A function's own AST, parsed from its module's text (None when the text cannot be read or parsed)."""
        text = self._text(function.module.path) if hasattr(function, "module") else None
        if text is None or function.lineno is None or function.endlineno is None:
            return None
        try:
            tree = ast.parse(textwrap.dedent("\n".join(text.splitlines()[function.lineno - 1 : function.endlineno])))
        except SyntaxError:
            return None
        return next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)

    def _returns_its_argument(self, decorator_path: str) -> bool:
        """A decorator of the library whose every ``return`` hands back its first parameter (registries, checks)."""
        if not self.inside(decorator_path):
            return False
        resolved = self.resolve(decorator_path)
        if not resolved.found or not isinstance(resolved.obj, griffe.Function) or not resolved.obj.parameters:
            return False
        node = self._function_node(resolved.obj)
        if node is None or not node.args.args:
            return False
        first = node.args.args[0].arg
        returns = [n for n in ast.walk(node) if isinstance(n, ast.Return)]
        return bool(returns) and all(isinstance(r.value, ast.Name) and r.value.id == first for r in returns)

    def _transform_options(self, decorator_path: str) -> dict[str, Any] | None:
        """A decorator function marked with @dataclass_transform makes classes dataclass-like."""
        if not self.inside(decorator_path):
            return None
        resolved = self.resolve(decorator_path)
        if not resolved.found or not isinstance(resolved.obj, griffe.Function):
            return None
        keywords = _transform_keywords(resolved.obj)
        return None if keywords is None else {k: v == "True" for k, v in keywords.items()}


def _transform_keywords(obj: Any) -> dict[str, str] | None:
    """The keywords of ``@dataclass_transform(...)`` on a function or class, None when it has none."""
    for decorator in obj.decorators:
        expr = decorator.value
        target = expr.function if isinstance(expr, griffe.ExprCall) else expr
        if getattr(target, "canonical_path", "") in DATACLASS_TRANSFORM:
            return {
                a.name: str(a.value)
                for a in (expr.arguments if isinstance(expr, griffe.ExprCall) else [])
                if isinstance(a, griffe.ExprKeyword)
            }
    return None


def _extra_option(text: str) -> str | bool:
    """pydantic's ``extra`` setting named in a config's source text (False: not set, pydantic ignores extras)."""
    for option in ("forbid", "allow", "ignore"):
        if re.search(rf"extra\s*=\s*(['\"]{option}['\"]|Extra\.{option})", text):
            return option
    return False


LITERAL_ALL = re.compile(r"^__all__\s*(?::[^=]*)?=\s*[\[(]([^\])]*)[\])]\s*$", re.MULTILINE)
QUOTED = re.compile(r"""['"]([A-Za-z_][A-Za-z0-9_]*)['"]""")


def _literal_all(text: str) -> set[str] | None:
    """The names of a module's ``__all__`` when it is one literal list or tuple of strings (assigned once, never
    extended); None otherwise (then only parsing the module tells)."""
    found = LITERAL_ALL.findall(text)
    if len(found) != 1 or re.search(r"^__all__\s*(\+=|\.(append|extend))", text, re.MULTILINE):
        return None
    body = re.sub(r"#[^\n]*", "", found[0])
    names = QUOTED.findall(body)
    return set(names) if re.fullmatch(r"[\s,]*", QUOTED.sub("", body)) else None


def _assigned_version(text: str) -> str | None:
    """The string a module assigns to ``__version__`` (or ``version``) at its top level; assignments in ``except``
    fallbacks ("dev" when the generated version file is missing) are not the release's."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    statements = list(tree.body)
    for node in tree.body:  # the body (not the handlers) of a top-level try runs first
        if isinstance(node, ast.Try):
            statements += node.body
    for node in statements:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            if any(isinstance(t, ast.Name) and t.id in ("__version__", "version") for t in node.targets):
                return node.value.value
    return None


def _line(member: Any) -> int:
    """Where a member is bound in its module (an alias's own import line, not its target's)."""
    return (member.alias_lineno if member.is_alias else member.lineno) or 0


def _member_or_stub_overload(owner: Any, name: str) -> Any:
    """A member by name; in stubs (.pyi) a name defined only by ``@overload``s lives in ``owner.overloads``."""
    member = owner.members.get(name)
    if member is None:
        overloads = getattr(owner, "overloads", {}).get(name) if hasattr(owner, "overloads") else None
        if overloads:
            return overloads[0]
    return member


def _c3_merge(sequences: list[list[tuple[str, Any]]], heads: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """C3 merge of the bases' linearisations and the list of bases (by path); depth-first on conflict."""
    pending = [list(s) for s in sequences] + [list(heads)]
    result: list[tuple[str, Any]] = []
    while any(pending):
        for sequence in pending:
            if not sequence:
                continue
            candidate = sequence[0]
            if not any(candidate[0] in [p for p, _ in other[1:]] for other in pending):
                break
        else:  # inconsistent hierarchy: fall back to depth-first, first occurrence
            seen: set[str] = {p for p, _ in result}
            for sequence in sequences:
                for entry in sequence:
                    if entry[0] not in seen:
                        result.append(entry)
                        seen.add(entry[0])
            return result
        result.append(candidate)
        pending = [[e for e in s if e[0] != candidate[0]] for s in pending]
    return result
