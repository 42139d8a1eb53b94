"""Rewrite the tables of README.md and docs/ from the code: the
compatibility table (declarations) in README.md, the patch table (patch
modules) in docs/patches.md, the environment variables (envvars) and the
configuration reference (PoolConfig's, MooncakeConfig's and TieredConfig's fields) in
docs/configuration.md, the pool's metrics (pool.prom) in
docs/operations.md.  tests/test_readme.py fails when one is stale;
``--check`` exits 1 then."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BEGIN, END = "<!-- patch-table:begin -->", "<!-- patch-table:end -->"
CBEGIN, CEND = "<!-- compat-table:begin -->", "<!-- compat-table:end -->"
PBEGIN, PEND = "<!-- pool-config-table:begin -->", "<!-- pool-config-table:end -->"
EBEGIN, EEND = "<!-- env-table:begin -->", "<!-- env-table:end -->"
MBEGIN, MEND = "<!-- pool-metrics-table:begin -->", "<!-- pool-metrics-table:end -->"
TBEGIN, TEND = "<!-- pool-tiered-table:begin -->", "<!-- pool-tiered-table:end -->"

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

    matrix = _matrix()
    plugins = plugin_reports()
    checked = {rel: json.loads(path.read_text()) for rel in RELEASES
               if (path := matrix.REPORT_DIR / f"{matrix.slug(rel)}.json").exists()}
    heads = list(RELEASES) + [f"{r['release']} ({r['platform']})" for r in plugins]
    lines = ["| patch | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for p in all_patches():
        # the declarations' verdict, then how the matrix checked it there
        # (reports/matrix: [e2e], [self-check])
        cells = [compat_cell(evaluate_row(p, release_fingerprints(p, rel),
                                          release_environment(rel)))
                 + (matrix.evidence(p.id, checked[rel]["patches"].get(p.id, {}),
                                    checked[rel]["level"]) if rel in checked else "")
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


def _matrix():
    """scripts/matrix.py (the reports' paths and evidence marks)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import matrix

    return matrix


def plugin_reports() -> list[dict]:
    """The committed reports of the platform plugins' wheels (vllm-ascend)."""
    m = _matrix()
    return [json.loads((m.REPORT_DIR / f"{m.slug(label)}.json").read_text())
            for label in m.PLUGIN_BUILDS if (m.REPORT_DIR / f"{m.slug(label)}.json").exists()]


def _between(text: str, begin: str, end: str, body: str) -> str:
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}{end}{tail}"


ROOT = Path(__file__).resolve().parent.parent


def _tables() -> dict[str, list[tuple[str, str, object]]]:
    """file (relative to the repository) -> its (begin, end, renderer)s."""
    from vllm_layerwise_patch.envvars import markdown_table
    from vllm_layerwise_patch.listing import render_markdown
    from vllm_layerwise_patch.pool.config import PoolConfig
    from vllm_layerwise_patch.pool.config_tiered import TieredConfig
    from vllm_layerwise_patch.pool.prom import markdown_table as metrics_table

    return {"README.md": [(CBEGIN, CEND, compat_table)],
            "docs/patches.md": [(BEGIN, END, render_markdown)],
            "docs/configuration.md": [(EBEGIN, EEND, markdown_table),
                                      (PBEGIN, PEND, PoolConfig.markdown_table),
                                      (TBEGIN, TEND, TieredConfig.markdown_table)],
            "docs/operations.md": [(MBEGIN, MEND, metrics_table)]}


def rendered(name: str, text: str) -> str:
    """``text`` (the file ``name``) with its tables rendered from the code."""
    for begin, end, render in _tables()[name]:
        text = _between(text, begin, end, render())
    return text


def stale() -> list[str]:
    """The files whose tables differ from the code."""
    return [name for name in _tables()
            if rendered(name, (ROOT / name).read_text()) != (ROOT / name).read_text()]


def main() -> int:
    if "--check" in sys.argv:
        bad = stale()
        for name in bad:
            print(f"stale: {name} (run: python scripts/render_readme.py)")
        return 1 if bad else 0
    for name in _tables():
        path = ROOT / name
        text = path.read_text()
        new = rendered(name, text)
        if new != text:
            path.write_text(new)
            print(f"rendered {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
