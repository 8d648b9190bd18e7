"""The decode-step table from results.txt: ms/token before → after (the lower of the two reps of
each condition: noise only adds time) and aten ops per token, per mixer and cache position.
Writes summary.md next to this file.

    python3 results/decode-step/summary.py
"""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
LINE = re.compile(r"(\w+) threads=(\d) rep=\d (before|after): (op )?(\w+) position (\d+): ([\d.]+) ms/token(?:, (\d+) aten ops/token)?")


def main() -> None:
    best: dict[tuple, float] = {}
    ops: dict[tuple, int] = {}
    for line in (HERE / "results.txt").read_text().splitlines():
        match = LINE.fullmatch(line.strip())
        if not match:
            continue
        load, threads, tree, op, mixer, position, ms, count = match.groups()
        mixer = f"{mixer} (op)" if op else mixer
        key = (load, int(threads), mixer, int(position), tree)
        best[key] = min(best.get(key, float("inf")), float(ms))
        if count is not None:
            ops[mixer, tree] = int(count)
    conditions = sorted({k[:2] for k in best}, key=lambda c: (c[0] != "quiet", c[1]))
    cells = sorted({k[2:4] for k in best}, key=lambda c: (list(dict.fromkeys(k[2] for k in best)).index(c[0]), c[1]))
    lines = ["# Decode step, before → after (ms/token, the lower of 2 reps)", "",
             "`python3 results/decode-step/summary.py` from `results.txt`. mini preset, batch 1; *busy*: one "
             "competing CPU-bound process on the 2 cores. *(op)*: the step function alone (B=1, 8 query heads on 2 kv "
             "heads, d=64) from a cache of that many tokens.", "",
             "| mixer | position | aten ops/token | " + " | ".join(f"{load}, {t} thread{'s' * (t > 1)}" for load, t in conditions) + " |",
             "|---|---:|---:|" + "---:|" * len(conditions)]
    for mixer, position in cells:
        row = [f"{best[(load, t, mixer, position, 'before')]:.2f} → {best[(load, t, mixer, position, 'after')]:.2f}"
               for load, t in conditions]
        counted = f"{ops[mixer, 'before']} → {ops[mixer, 'after']}" if (mixer, "before") in ops else "—"
        lines.append(f"| {mixer} | {position} | {counted} | " + " | ".join(row) + " |")
    (HERE / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
