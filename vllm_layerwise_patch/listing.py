"""``python -m vllm_layerwise_patch list``: each patch's documentation fields,
rendered from the patch modules themselves (also used to build README's table).
"""

from __future__ import annotations

import textwrap

from .patches import all_patches
from .registry import DOC_FIELDS


def render_text() -> str:
    out = []
    for p in all_patches():
        fields = p.doc_fields()
        out.append(f"{p.id}  ({p.kind.value}"
                   + (", correctness-critical" if p.correctness_critical else "")
                   + (", default on" if p.default_enabled else ", opt-in") + ")")
        out += textwrap.wrap(p.summary, 76, initial_indent="  ", subsequent_indent="  ")
        for name in DOC_FIELDS:
            if name in fields:
                out += textwrap.wrap(f"{name}: {fields[name]}", 76,
                                     initial_indent="  ", subsequent_indent="      ")
        out.append("  Verified releases: " + ", ".join(v.release for v in p.verified))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def render_markdown() -> str:
    rows = ["| patch | target | upstream | why | removal condition | verified releases |",
            "|---|---|---|---|---|---|"]
    for p in all_patches():
        f = p.doc_fields()
        cells = [f"`{p.id}`", f.get("Target", ", ".join(t.name for t in p.targets)),
                 f.get("Upstream", ""), f.get("Why", ""), f.get("Removal condition", p.removal),
                 ", ".join(v.release for v in p.verified)]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def main(argv: list[str]) -> int:
    print(render_markdown() if "--markdown" in argv else render_text(), end="")
    return 0
