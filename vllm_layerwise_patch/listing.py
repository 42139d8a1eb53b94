"""``python -m vllm_layerwise_patch list``: each patch's documentation fields,
rendered from the patch modules' docstrings (also the patch table of docs/patches.md).
"""

from __future__ import annotations

import argparse
import textwrap

from .registry import DOC_FIELDS


def _wrap(text: str, indent: str, subsequent: str) -> list[str]:
    # ids and hyphenated words stay whole
    return textwrap.wrap(text, 76, initial_indent=indent, subsequent_indent=subsequent,
                         break_on_hyphens=False)


def render_text() -> str:
    from .patches import all_patches

    out = []
    for p in all_patches():
        fields = p.doc_fields()
        out.append(f"{p.id}  ({p.kind.value}"
                   + (", correctness-critical" if p.correctness_critical else "")
                   + f", {p.default_label()})")
        out += _wrap(p.summary, "  ", "  ")
        for name in DOC_FIELDS:
            if name in fields:
                out += _wrap(f"{name}: {fields[name]}", "  ", "      ")
        out.append("  Verified releases: " + ", ".join(v.release for v in p.verified))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def render_markdown() -> str:
    from .patches import all_patches

    rows = ["| patch | target | upstream | why | removal condition | verified releases |",
            "|---|---|---|---|---|---|"]
    for p in all_patches():
        f = p.doc_fields()
        cells = [f"`{p.id}`", f.get("Target", ", ".join(t.name for t in p.targets)),
                 f.get("Upstream", ""), f.get("Why", ""), p.removal,
                 ", ".join(v.release for v in p.verified)]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("--markdown", action="store_true", help="the patch table of docs/patches.md")
    return ap


def run(ns: argparse.Namespace) -> int:
    print(render_markdown() if ns.markdown else render_text(), end="")
    return 0


def main(argv: list[str]) -> int:
    ap = add_arguments(argparse.ArgumentParser(prog="python -m vllm_layerwise_patch list"))
    return run(ap.parse_args(argv))
