"""README stays true to the code: the patch table and the two commands."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_patch_table_matches_patch_modules():
    mod = runpy.run_path(str(ROOT / "scripts" / "render_readme.py"))
    text = (ROOT / "README.md").read_text()
    assert mod["rendered"](text) == text, "run: python scripts/render_readme.py"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    assert blocks[0].strip() == "bash scripts/demo.sh"
    assert blocks[1].strip() == "bash scripts/test.sh"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "exec bash scripts/test.sh" in ci
