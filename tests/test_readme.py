"""README and docs/ stay true to the code: the rendered tables (README's
compatibility table, docs/patches.md, docs/configuration.md,
docs/operations.md), the compatibility table against doctor, and README's
two commands."""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path

from conftest import clean_env, run_py

ROOT = Path(__file__).resolve().parent.parent


def test_rendered_tables_match_the_code():
    mod = runpy.run_path(str(ROOT / "scripts" / "render_readme.py"))
    files = mod["_tables"]()
    assert set(files) == {"README.md", "docs/patches.md", "docs/configuration.md",
                          "docs/operations.md"}
    for name in files:
        text = (ROOT / name).read_text()
        assert mod["rendered"](name, text) == text, f"{name}: run python scripts/render_readme.py"
    assert mod["stale"]() == []


def test_a_stale_table_is_caught():
    """Negative control: a row removed from a rendered table is put back."""
    mod = runpy.run_path(str(ROOT / "scripts" / "render_readme.py"))
    text = (ROOT / "docs" / "configuration.md").read_text()
    cut = text.replace("| `load_threads` |", "| `load_threadz` |", 1)
    assert cut != text and mod["rendered"]("docs/configuration.md", cut) == text


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    assert blocks[0].strip() == "bash scripts/demo.sh"
    assert blocks[1].strip() == "bash scripts/test.sh"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "exec bash scripts/test.sh" in ci


def test_the_slow_set_is_named_in_the_readme_and_selected_by_the_script():
    """README's line for the slow set runs a set the script knows; a bad set
    name is refused before any set-up."""
    import subprocess

    readme = (ROOT / "README.md").read_text()
    assert "`VLP_TESTS=slow bash scripts/test.sh`" in readme
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert 'default) select=(-m "not slow")' in script and "slow) select=(-m slow)" in script
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "test.sh")], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin", "VLP_TESTS": "fast",
                                         "VENV": "/nonexistent-venv"}, timeout=60)
    assert bad.returncode == 2 and "VLP_TESTS must be" in bad.stderr


def _compat_cells(release: str) -> dict[str, str]:
    """patch id -> README compatibility cell of ``release``."""
    text = (ROOT / "README.md").read_text()
    table = text.split("<!-- compat-table:begin -->")[1].split("<!-- compat-table:end -->")[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in table.strip().splitlines()]
    column = rows[0].index(release)
    return {r[0].strip("`"): r[column] for r in rows[2:]}


# doctor's state -> the README's word for it
_README_WORD = {"applied": "verified", "not-needed": "not needed", "opt-in": "opt-in"}


def _doctor_states(selection: str) -> tuple[str, dict[str, dict]]:
    """(installed release, patch id -> doctor's row) for that selection."""
    proc = run_py("import sys, runpy; sys.argv = ['x', 'doctor', '--json']; "
                  "runpy.run_module('vllm_layerwise_patch', run_name='__main__')",
                  env=clean_env(VLLM_LAYERWISE_PATCH=selection), check=False)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    release = f"{report['environment']['vllm_distribution']} {report['environment']['vllm_version']}"
    return release, {p["id"]: p for p in report["patches"]}


def test_compatibility_table_agrees_with_doctor_on_the_installed_release():
    # VLLM_LAYERWISE_PATCH=1: every cell's first word is doctor's state here,
    # opt-in patches included (bytewise-precopy-kernel off NPU)
    release, rows = _doctor_states("1")
    cells = _compat_cells(release)
    opt_in = [pid for pid, row in rows.items() if row["state"] == "opt-in"]
    assert opt_in, "no opt-in patch on this platform: the test checks nothing"
    for pid, row in rows.items():
        word = _README_WORD.get(row["state"], "unsupported")
        assert cells[pid].split(" (by id")[0].startswith(word), (pid, row["state"], cells[pid])
    # selected by id, an opt-in patch does what the cell's parenthesis says
    for pid in opt_in:
        _, by_id = _doctor_states(pid)
        word = _README_WORD.get(by_id[pid]["state"], "unsupported")
        assert cells[pid].startswith("opt-in") and f"(by id: {word}" in cells[pid], (
            pid, by_id[pid]["state"], cells[pid])
