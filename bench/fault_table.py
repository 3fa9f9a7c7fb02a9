"""Render the fault matrix (``var/reliability/*.json``, written by tests/integration/test_faults.py) into a doc.

``python -m bench.fault_table [--records var/reliability] [--doc docs/reliability.md]`` replaces the
text between ``<!-- fault-matrix:begin -->`` and ``<!-- fault-matrix:end -->`` in the doc (appending
a section with those markers when it has none); the rest of the doc is left as it is.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["BEGIN", "END", "render_table", "splice"]

BEGIN = "<!-- fault-matrix:begin -->"
END = "<!-- fault-matrix:end -->"


def _cell(value: Any) -> str:
    return "—" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def render_table(records: Sequence[dict[str, Any]]) -> str:
    """The Markdown table (one row per record, in ``order``) followed by each row's notes."""
    rows = sorted(records, key=lambda r: (r.get("order", 99), r["fault"]))
    when = max((r.get("recorded_at_unix_s", 0.0) for r in rows), default=0.0)
    lines = [
        BEGIN,
        f"_Rendered by `make reliability` from {len(rows)} records of one run, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(when))}; 2 shared cores._",
        "",
        "| # | fault | injected how | load | accepted | completed | lost | duplicated | refused | failed "
        "| time to recover (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        failed = ", ".join(f"{k} {v}" for k, v in r.get("failed", {}).items()) or "0"
        lost = f"**{r['lost']}**"
        lines.append(
            f"| {i} | {_cell(r['fault'])} | {_cell(r['injected'])} | {_cell(r['load'])} | {r['accepted']} "
            f"| {r['completed']} | {lost} | {r['duplicated']} | {r['refused']} | {_cell(failed)} "
            f"| {_cell(r.get('recover_s'))} |"
        )
    lines += ["", "Notes, by row:", ""]
    lines += [f"{i}. {r.get('notes') or '—'}" for i, r in enumerate(rows, 1)]
    lines.append(END)
    return "\n".join(lines)


def splice(doc: str, table: str, heading: str = "## Fault matrix (`make reliability`)") -> str:
    """``doc`` with the marked block replaced by ``table`` (or a new section holding it appended)."""
    if BEGIN in doc and END in doc:
        head, rest = doc.split(BEGIN, 1)
        return head + table + rest.split(END, 1)[1]
    return doc.rstrip("\n") + f"\n\n{heading}\n\n{table}\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--records", type=Path, default=Path("var/reliability"))
    p.add_argument("--doc", type=Path, default=Path("docs/reliability.md"))
    args = p.parse_args(argv)
    records = [json.loads(f.read_text()) for f in sorted(args.records.glob("*.json"))]
    if not records:
        print(f"no records in {args.records}: run the fault tests first")
        return 1
    args.doc.write_text(splice(args.doc.read_text(), render_table(records)))
    print(f"{args.doc}: fault matrix with {len(records)} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
