"""The checker's report as text (rich), JSON, or SARIF 2.1.0 (code-scanning UIs read it)."""

from __future__ import annotations

from typing import Any

from .. import __version__
from .check import Report

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


def as_text(report: Report) -> str:
    lines = []
    for finding in report.findings:
        where = f" (defined at {finding.defined_at})" if finding.defined_at else ""
        lines.append(f"{finding.path}:{finding.line}: {finding.level}: {finding.target}: {finding.message}{where}")
    unverified = sum(report.unverified.values())
    lines.append(
        f"{report.package} {report.version} ({report.source}): {report.call_sites} calls"
        + (f", {report.overrides} overrides" if report.overrides else "")
        + f" and {report.imports} imports checked in {report.seconds:.2f} s: {len(report.errors)} errors, "
        f"{len(report.warnings)} warnings, {unverified} unverified"
    )
    for reason, count in report.unverified.most_common():
        examples = ", ".join(report.unverified_examples.get(reason, []))
        lines.append(f"  unverified x{count}: {reason} (e.g. {examples})")
    return "\n".join(lines)


def as_sarif(report: Report) -> dict[str, Any]:
    rules = [
        {"id": "eaglet.api-break", "shortDescription": {"text": "call that the installed library version rejects"}},
        {"id": "eaglet.api-warning", "shortDescription": {"text": "call that may misbehave with the library version"}},
    ]
    results = [
        {
            "ruleId": "eaglet.api-break" if f.level == "error" else "eaglet.api-warning",
            "level": f.level,
            "message": {"text": f"{f.target}: {f.message} ({report.package} {report.version})"},
            "locations": [{"physicalLocation": {"artifactLocation": {"uri": f.path}, "region": {"startLine": f.line}}}],
        }
        for f in report.findings
    ]
    return {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {"driver": {"name": "eaglet preflight calls", "version": __version__, "rules": rules}},
                "results": results,
            }
        ],
    }
