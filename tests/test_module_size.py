"""One module, one concern: no module of the package grows past
``MAX_LINES`` lines (split it by concern when one would).  The whole
package is globbed, whatever its subpackages; the checker is shown to fail
on a module one line over."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_layerwise_patch"
MAX_LINES = 350


def oversized(paths, root: Path, limit: int = MAX_LINES) -> list[str]:
    """``path: N lines`` (relative to ``root``) for each of ``paths`` longer
    than ``limit`` lines."""
    out = []
    for path in paths:
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > limit:
            out.append(f"{path.relative_to(root)}: {n} lines")
    return out


def test_no_module_of_the_package_is_over_the_limit():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 50  # the package itself, not an empty glob
    over = oversized(modules, PACKAGE.parent)
    assert not over, f"over {MAX_LINES} lines (split by concern): " + "; ".join(over)


def test_negative_control_a_module_one_line_over_fails(tmp_path):
    at, over = tmp_path / "at.py", tmp_path / "over.py"
    at.write_text("x = 1\n" * MAX_LINES)
    over.write_text("x = 1\n" * (MAX_LINES + 1))
    assert oversized([at, over], tmp_path) == [f"over.py: {MAX_LINES + 1} lines"]
