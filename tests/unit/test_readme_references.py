"""Where the product's messages send a user to a README section by name, that section exists.

``fleet models pin`` without a store said "see README 'Versioned models'", a heading the README never had.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "broker", "workers", "producer", "gateway", "tools", "bench", "store", "planner")
REFERENCE = re.compile(r"""README[\s"']*(?:section\s*)?(?:'([^'\n]+)'|‘([^’\n]+)’|\\?"([^"\n\\]+)\\?")""")
"""``README 'Name'`` (quotes of any kind), spread over two string literals or not."""


def _headings() -> set[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    return {line.lstrip("#").strip() for line in lines if line.startswith("#")}


def _references() -> list[tuple[str, str]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            text = re.sub(r'"\s*\n\s*f?"', "", path.read_text())  # implicit concatenation of string literals
            for match in REFERENCE.finditer(text):
                name = next(group for group in match.groups() if group)
                found.append((f"{path.relative_to(ROOT)}", name))
    return found


def test_every_readme_section_a_message_names_exists() -> None:
    references = _references()
    assert references, "the pattern finds no reference at all: it no longer matches how messages name sections"
    headings = _headings()
    missing = [(where, name) for where, name in references if name not in headings]
    assert not missing, missing
