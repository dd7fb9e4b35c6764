"""Static API-compatibility checking: calls from user code into a library, bound against the library's
signatures as written in its source, without importing it (`eaglet preflight calls`).

  library.py   the library, read module by module with griffe and resolved lazily (aliases, re-exports,
               wildcard imports, inheritance, generated ``__init__`` of dataclass-like classes)
  signature.py the parameters a call must bind to, and the binding itself
  callsites.py the caller's calls into the library, with what each callee expression refers to
  check.py     the two together: findings (errors, warnings) and the unverified tally; upgrade mode
  report.py    text, JSON and SARIF
"""
