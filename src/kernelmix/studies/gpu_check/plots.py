"""gpu-check's PNGs: part (b)'s forward+backward time against T and decode latency against the position."""

from __future__ import annotations

from pathlib import Path

from ...output import pyplot

def write_plots(report: dict, out: Path) -> list[Path]:
    """``bench_time.png`` (forward+backward time against T) and ``decode.png`` (latency against the
    position); a note instead where matplotlib is missing or nothing was measured."""
    part = report["parts"]["b"]
    try:
        plt = pyplot()
    except ImportError as error:
        part.setdefault("notes", []).append(f"no plots: {error}")
        return []
    written = []
    series = {
        "bench_time.png": ("forward+backward time (bf16)", "T", "ms",
                           [(r["mixer"], r["length"], r.get("forward_backward_ms")) for r in part.get("records", [])]),
        "decode.png": ("decode latency", "position", "ms / token",
                       [(d["mixer"], d["position"], d["step_ms"]) for d in part.get("decode", [])]),
    }
    for filename, (title, xlabel, ylabel, points) in series.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for mixer in dict.fromkeys(m for m, _, _ in points):
            mine = sorted((x, y) for m, x, y in points if m == mixer and x is not None and y)
            if mine:
                ax.plot(*zip(*mine), marker="o", label=mixer)
        if ax.lines:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.legend()
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set(title=f"{title} — {report['environment'].get('gpu', report['environment']['device'])}", xlabel=xlabel,
               ylabel=ylabel)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=110)
        plt.close(fig)
        written.append(out / filename)
    return written
