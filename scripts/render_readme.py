"""Rewrite README.md's patch table from the patch modules (run after editing a
patch's docstring; tests/test_readme.py fails when the table is stale)."""

from __future__ import annotations

import sys
from pathlib import Path

BEGIN, END = "<!-- patch-table:begin -->", "<!-- patch-table:end -->"


def rendered(readme: str) -> str:
    from vllm_layerwise_patch.listing import render_markdown

    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{render_markdown()}{END}{tail}"


def main() -> int:
    path = Path(__file__).resolve().parent.parent / "README.md"
    text = path.read_text()
    new = rendered(text)
    if "--check" in sys.argv:
        return 0 if new == text else 1
    path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
