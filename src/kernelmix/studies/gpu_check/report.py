"""gpu-check's report: ``gpu_check.json`` and ``gpu_check.md``, its tables (markdown and the
console's rich tables) and the plots of part (b)."""

from __future__ import annotations

import sys
from pathlib import Path

from ...output import write_json_atomic, write_text_atomic
from .plots import write_plots
from .settings import FLA_PEER, MIXERS, solve_variants

def write_report(report: dict, out: Path, *, plots: bool = False) -> list[Path]:
    written = [write_json_atomic(out / "gpu_check.json", report),
               write_text_atomic(out / "gpu_check.md", format_markdown(report))]
    if plots:
        written += write_plots(report, out)
    return written


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None where either is missing (or ``b`` is 0)."""
    return a / b if a is not None and b else None


def format_error(value: float | str | None) -> str:
    """A relative error for a table: ``1.2e-05``, a non-finite one's text, or "-"."""
    return "-" if value is None else value if isinstance(value, str) else f"{value:.1e}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}" if value < 10 else f"{value:.1f}"


def check_table(part: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["op", "backend", "dtype", "case", "value err", "worst grad err", "tol", "result"]
    rows = []
    for row in part.get("checks", []):
        worst = "-" if "error" in row else f"{format_error(row['worst_grad_error'])} ({row['worst_grad']})"
        result = "pass" if row["passed"] else ("FAIL: " + row["error"] if "error" in row else "FAIL")
        rows.append([row["op"], row["backend"], row["dtype"], row["case"], format_error(row.get("value_error")), worst,
                     f"{row['tolerance']:.0e}", result])
    return headers, rows


def bench_table(part: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["mixer", "T", "fwd ms", "fwd+bwd ms", "vs SDPA", "peak MiB", "peak vs SDPA", "note"]
    records = part.get("records", [])
    sdpa = {r["length"]: r for r in records if r["mixer"] == "softmax"}
    rows = []
    order = [*MIXERS, *solve_variants(), FLA_PEER]
    for r in sorted(records, key=lambda r: (r["length"], order.index(r["mixer"]))):
        base = sdpa.get(r["length"], {})
        time_ratio = ratio(r.get("forward_backward_ms"), base.get("forward_backward_ms"))
        peak_ratio = ratio(r.get("peak_memory_mib"), base.get("peak_memory_mib"))
        peak = r.get("peak_memory_mib")
        rows.append([r["mixer"], str(r["length"]), _ms(r.get("forward_ms")), _ms(r.get("forward_backward_ms")),
                     "-" if time_ratio is None else f"{time_ratio:.2f}×", "-" if peak is None else f"{peak:.0f}",
                     "-" if peak_ratio is None else f"{peak_ratio:.2f}×", r.get("note", "")])
    return headers, rows


def decode_table(part: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["mixer", "position", "ms / token", "vs first position"]
    first: dict[str, float] = {}
    rows = []
    for d in part.get("decode", []):
        if d["step_ms"] is None:
            rows.append([d["mixer"], "-", "-", d.get("note", "")])
            continue
        first.setdefault(d["mixer"], d["step_ms"])
        rows.append([d["mixer"], str(d["position"]), _ms(d["step_ms"]), f"{d['step_ms'] / first[d['mixer']]:.2f}×"])
    return headers, rows


def target_table(part: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["target", "measured", "result"]
    rows = []
    for t in part.get("targets", []):
        measured = "-" if t["measured"] is None else f"{t['measured']:.3g} {t['unit']}".replace(" ×", "×")
        result = t["note"] if t["passed"] is None else ("pass" if t["passed"] else "FAIL")
        rows.append([t["target"], measured, result])
    return headers, rows


def compare_table(part: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["mixer", "T", "eval loss", "steps", "tokens/s", "train s"]
    rows = [[r["mixer"], str(r["length"]), f"{r['val_loss']:.3f}",
             "-" if r.get("steps") is None else f"{r['steps']:.0f}",
             f"{r['tokens_per_s']:.0f}", "-" if r.get("train_s") is None else f"{r['train_s']:.1f}"]
            for r in part.get("summary", [])]
    return headers, rows


def report_tables(report: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """``(title, headers, rows)`` of every table, for the markdown and the console alike."""
    parts = report["parts"]
    tables = [("(a) op checks", *check_table(parts["a"])), ("(b) bench", *bench_table(parts["b"])),
              ("(b) decode latency", *decode_table(parts["b"])), ("(b) targets (issue 16)", *target_table(parts["b"])),
              ("(c) compare", *compare_table(parts["c"]))]
    return [table for table in tables if table[2]]


def _markdown_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
    return [line(headers), line(["---"] * len(headers)), *map(line, rows)]


def format_markdown(report: dict) -> str:
    env, settings = report["environment"], report["settings"]
    lines = [
        "# kernelmix gpu-check", "",
        f"Device {env.get('gpu', env['device'])}; torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, "
        f"python {env['python']}; {'quick dry run' if settings['quick'] else 'full run'}; started {report['started']}"
        + (f", last written {report['finished']}" if report.get("finished") else "") + ".", "",
    ]
    for name, part in report["parts"].items():
        seconds = f" ({part['seconds']:.0f} s)" if "seconds" in part else ""
        summary = f"; {part['passed']} passed, {part['failed']} failed" if "passed" in part else ""
        lines.append(f"- ({name}) {part['title']}: {part['status']}{seconds}{summary}")
    for title, headers, rows in report_tables(report):
        lines += ["", f"## {title}", "", *_markdown_table(headers, rows)]
    notes = [f"({name}) {note}" for name, part in report["parts"].items() for note in part.get("notes", [])]
    notes += [f"(b) {mixer}: {why}" for mixer, why in report["parts"]["b"].get("stopped", {}).items()]
    if notes:
        lines += ["", "## Notes", "", *[f"- {note}" for note in notes]]
    return "\n".join(lines) + "\n"


def print_tables(report: dict, *, file=None) -> None:
    """The tables on the console: rich tables when rich imports, else the markdown."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_markdown(report), file=file or sys.stdout)
        return
    console = Console(file=file, soft_wrap=True)
    for title, headers, rows in report_tables(report):
        table = Table(title=title, title_justify="left")
        for header in headers:
            table.add_column(header, overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for name, part in report["parts"].items():
        console.print(f"({name}) {part['title']}: {part['status']}", highlight=False, markup=False)
