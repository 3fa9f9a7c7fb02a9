"""The soak's and the fault matrix's pure parts: plateau verdicts, key families, the table splice."""

from __future__ import annotations

import pytest

from bench.fault_table import BEGIN, END, render_table, splice
from bench.soak_report import key_prefix, plateau

MIB = 1024 * 1024


@pytest.mark.parametrize(
    ("values", "flat"),
    [
        ([100 * MIB, 150 * MIB, 150 * MIB, 151 * MIB, 151 * MIB, 152 * MIB], True),  # warm-up, then flat
        ([100 * MIB, 120 * MIB, 140 * MIB, 160 * MIB, 180 * MIB, 200 * MIB], False),  # steady growth
        ([4 * MIB, 5 * MIB, 6 * MIB, 7 * MIB, 8 * MIB, 9 * MIB], True),  # +40 %, but only 2 MiB: allocator noise
    ],
)
def test_plateau_compares_last_third_with_middle(values: list[int], flat: bool) -> None:
    assert plateau("rss", [float(v) for v in values]).flat() is flat


def test_plateau_needs_three_readings() -> None:
    with pytest.raises(ValueError, match="at least 3"):
        plateau("rss", [1.0, 2.0])


@pytest.mark.parametrize(
    ("key", "family"),
    [
        ("celery-task-meta-abc", "celery-task-meta-*"),
        ("fleet:req:abc", "fleet:req:*"),
        ("fleet:model:demo-lm:card", "fleet:model:*:card"),
        ("fleet:dead-letter", "fleet:dead-letter"),
        ("_kombu.binding.fleet.demo-lm", "_kombu.*"),
        ("fleet.demo-lm", "fleet.demo-lm"),
    ],
)
def test_key_prefix(key: str, family: str) -> None:
    assert key_prefix(key) == family


def test_fault_table_replaces_only_its_block() -> None:
    rec = {"fault": "f", "injected": "a|b", "load": "l", "accepted": 3, "completed": 3, "lost": 0,
           "duplicated": 0, "refused": 1, "recover_s": None, "notes": "n"}
    table = render_table([rec])
    assert "a\\|b" in table and "| **0** |" in table and "| — |" in table
    doc = splice("# Doc\n\nkept\n", table)
    assert doc.startswith("# Doc\n\nkept\n") and BEGIN in doc and END in doc
    again = splice(doc + "\nafter\n", render_table([rec | {"lost": 2}]))
    assert again.count(BEGIN) == 1 and "| **2** |" in again and again.endswith("after\n")
