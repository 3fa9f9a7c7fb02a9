"""Markdown formatting helpers of the bench report (pure)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["fmt", "md_table", "mib"]


def fmt(value: Any, digits: int = 1) -> str:
    """A number with ``digits`` decimals; '–' for None or NaN; strings pass through."""
    if value is None:
        return "–"
    if isinstance(value, str):
        return value
    x = float(value)
    return "–" if math.isnan(x) else f"{x:,.{digits}f}"


def mib(num_bytes: Any) -> str:
    """Bytes as MiB with one decimal ('–' when unknown)."""
    return "–" if num_bytes is None else f"{float(num_bytes) / 2**20:,.1f}"


def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub Markdown table (cells are used as given; '|' inside a cell is escaped)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)
