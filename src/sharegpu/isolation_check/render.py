"""The table of ``sharegpu isolation-check``."""

from __future__ import annotations

from typing import Any

from .check import Check, Report


def value_text(v: Any, unit: str) -> str:
    """A measured or asked value with its unit, as the table and bench/isolation_gpu.py show it."""
    if v is None:
        return "—"
    if isinstance(v, bool) or not isinstance(v, int | float):
        text = str(v)
        return f"{text} {unit}" if unit and text[-1:].isdigit() else text
    if unit == "×":
        return f"{v:,.3f}×"
    text = f"{v:,.1f}" if isinstance(v, float) else f"{v:,}"
    return f"{text} {unit}" if unit else text


def _result(c: Check) -> str:
    if c.ok is None:
        return "[dim]info[/dim]"
    return "[green]pass[/green]" if c.ok else "[bold red]FAIL[/bold red]"


def table(report: Report, console: Any) -> None:
    from rich.table import Table

    req, gpu = report.request, report.gpu
    core = f", {req.core} % compute" if req.core is not None else ""
    title = (f"GPU {gpu.get('index', req.gpu)}: {gpu.get('name', '?')}, "
             f"{gpu.get('total_mib', 0):,} MiB, driver {gpu.get('driver_version', '?')} — "
             f"{req.backend}, {req.mem_gib} GiB{core}")
    console.print(title, markup=False, highlight=False)
    t = Table()
    for col in ("check", "asked", "measured", "tolerance", "result"):
        t.add_column(col, justify="right" if col in ("asked", "measured") else "left")
    for c in report.checks:
        t.add_row(c.name, value_text(c.asked, c.unit), value_text(c.measured, c.unit), c.tolerance,
                  _result(c))
    console.print(t)
    for c in report.checks:
        if c.note and (c.ok is False or c.ok is None):
            console.print(f"  {c.name}: {c.note}", markup=False, highlight=False)
    if report.ok:
        console.print("[green]isolation holds[/green]")
    else:
        failed = ", ".join(c.name for c in report.checks if c.ok is False)
        console.print(f"[bold red]isolation does not hold:[/bold red] {failed}")
