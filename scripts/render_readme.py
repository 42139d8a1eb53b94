"""Rewrite README.md's tables from the code: the patch table (patch modules),
the compatibility table (declarations), the environment variables (envvars)
and the pool configuration table (PoolConfig's fields).  tests/test_readme.py
fails when one is stale."""

from __future__ import annotations

import sys
from pathlib import Path

BEGIN, END = "<!-- patch-table:begin -->", "<!-- patch-table:end -->"
CBEGIN, CEND = "<!-- compat-table:begin -->", "<!-- compat-table:end -->"
PBEGIN, PEND = "<!-- pool-config-table:begin -->", "<!-- pool-config-table:end -->"
EBEGIN, EEND = "<!-- env-table:begin -->", "<!-- env-table:end -->"

_CELL = {"verified": "verified", "not-needed": "not needed", "opt-in": "opt-in",
         "not-applicable": "unsupported", "drift": "unsupported (drift)",
         "absent": "absent", "platform": "other platform"}


def compat_cell(row: dict) -> str:
    """What ``VLLM_LAYERWISE_PATCH=1`` does with the patch on that release
    (doctor's state there) and, for an opt-in patch, what selecting it by id
    does."""
    by_id = row.get("by_id")
    return _CELL[row["state"]] + (f" (by id: {_CELL[by_id['state']]})" if by_id else "")


def compat_table() -> str:
    """release x patch, from the declarations and the release table."""
    from vllm_layerwise_patch.patches import all_patches
    from vllm_layerwise_patch.registry import (
        RELEASES,
        evaluate_row,
        release_environment,
        release_fingerprints,
    )

    plugins = plugin_reports()
    heads = list(RELEASES) + [f"{r['release']} ({r['platform']})" for r in plugins]
    lines = ["| patch | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for p in all_patches():
        cells = [compat_cell(evaluate_row(p, release_fingerprints(p, rel),
                                          release_environment(rel)))
                 for rel in RELEASES]
        cells += [_PLUGIN_CELL[r["patches"][p.id]["state"]].format(r["release"].rpartition(" ")[0])
                  for r in plugins]
        lines.append(f"| `{p.id}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


#: a platform plugin's column: what its wheel's source says (scripts/matrix.py
#: --plugin, committed under reports/matrix/), by the rules of registry.plugins
_PLUGIN_CELL = {"carried": "carried by {}", "not-needed": "not needed",
                "not-applicable": "unsupported (bypassed by {})",
                "applies": "applies (on a verified vLLM)"}


def plugin_reports() -> list[dict]:
    """The committed reports of the platform plugins' wheels (vllm-ascend)."""
    import json

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from matrix import PLUGIN_BUILDS, REPORT_DIR, slug

    return [json.loads((REPORT_DIR / f"{slug(label)}.json").read_text())
            for label in PLUGIN_BUILDS if (REPORT_DIR / f"{slug(label)}.json").exists()]


def _between(text: str, begin: str, end: str, body: str) -> str:
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}{end}{tail}"


def rendered(readme: str) -> str:
    from vllm_layerwise_patch.envvars import markdown_table
    from vllm_layerwise_patch.listing import render_markdown
    from vllm_layerwise_patch.pool.config import PoolConfig

    text = _between(readme, BEGIN, END, render_markdown())
    text = _between(text, CBEGIN, CEND, compat_table())
    text = _between(text, EBEGIN, EEND, markdown_table())
    return _between(text, PBEGIN, PEND, PoolConfig.markdown_table())


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
