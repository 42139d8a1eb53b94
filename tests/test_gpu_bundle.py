"""The carried vLLM for the GPU machine (tests/gpu/build_vllm_bundle.py): its
edits fail loudly on sources they do not fit, the stand-in ``_C`` ops compute
what vLLM's kernels compute, and - when the wheels are cached - the edits
apply to vLLM 0.34.0 and the bundle's engine path imports with nothing but
what the GPU machine's image has and what the bundle carries.

Wheels are looked up in ``VLP_GPU_WHEELS`` (directories separated by
``os.pathsep``), ``VLP_WHEEL_CACHE`` and ``.cache/wheels``; the tests that
need them skip when they are not there (nothing is downloaded here)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import clean_env

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "tests" / "gpu"
sys.path.insert(0, str(GPU))

import build_vllm_bundle as builder  # noqa: E402
import bundle_edits as edits  # noqa: E402


def caches() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get("VLP_GPU_WHEELS", "").split(os.pathsep) if p]
    dirs.append(Path(os.environ.get("VLP_WHEEL_CACHE", ROOT / ".cache" / "wheels")))
    return [d for d in dirs if d.is_dir()]


def vllm_wheel(release: str = "0.34.0") -> Path:
    w = builder.find_wheel(caches(), "vllm", release)
    if w is None:
        pytest.skip(f"no vllm {release} wheel cached (VLP_GPU_WHEELS / VLP_WHEEL_CACHE)")
    return w


# -- without any wheel ---------------------------------------------------------

TARGETS = {
    "platforms/cuda.py": "import vllm._C_stable_libtorch  # noqa\n",
    "utils/platform_utils.py": ("def is_uva_available() -> bool:\n"
                                "    return is_pin_memory_available() and not "
                                "current_platform.is_confidential_compute()\n"),
    "model_executor/warmup/minimax_m3_msa_warmup.py": "import cutlass\n"
                                                      "def minimax_m3_msa_warmup(worker):\n",
    "model_executor/warmup/kernel_warmup.py": "        minimax_m3_msa_warmup(worker)\n",
    "model_executor/models/qwen3_next.py": (
        "        if example_moe is None:\n"
        '            raise RuntimeError("No Qwen3Next layer found in the model.layers.")\n'),
    "v1/structured_output/backend_xgrammar.py": edits._SPDX + "xgr = LazyLoader(...)\n",
    "v1/structured_output/backend_guidance.py": edits._SPDX + "llguidance = LazyLoader(...)\n",
}


def sources(**changes: str | None) -> dict[str, bytes]:
    files = dict(TARGETS, **changes)
    return {k: v.encode() for k, v in files.items() if v is not None}


def test_every_edit_applies_to_text_that_fits():
    files = sources()
    done = edits.apply(files, "0.34.0")
    assert [d["edit"] for d in done] == [e.name for e in edits.EDITS["0.34.0"]]
    assert all(d["file"] and d["what"] and d["why"] for d in done), done
    assert files["_C_stable_libtorch.py"] == (GPU / "vllm_c_stand_in.py").read_bytes()
    uva = files["utils/platform_utils.py"].decode()
    assert "return False" in uva and edits.MARK in uva and "is_confidential" not in uva
    warm = files["model_executor/warmup/minimax_m3_msa_warmup.py"].decode()
    assert "cutlass" not in warm and "def minimax_m3_msa_warmup(worker)" in warm
    qwen = files["model_executor/models/qwen3_next.py"].decode()
    assert "raise RuntimeError" not in qwen and "self.num_moe_layers = 0" in qwen
    for name in ("backend_xgrammar.py", "backend_guidance.py"):
        text = files[f"v1/structured_output/{name}"].decode()
        assert text.startswith(edits._SPDX + "from __future__ import annotations")
    for name in ("_C_stable_libtorch.py", "utils/platform_utils.py",
                 "model_executor/warmup/minimax_m3_msa_warmup.py",
                 "v1/structured_output/backend_xgrammar.py"):
        compile(files[name], name, "exec")  # still Python


@pytest.mark.parametrize("path, text, why", [
    ("utils/platform_utils.py", "def is_uva_available() -> bool:\n    return True\n",
     "found it 0 times"),
    ("model_executor/models/qwen3_next.py", TARGETS["model_executor/models/qwen3_next.py"] * 2,
     "found it 2 times"),
    ("platforms/cuda.py", "import vllm._C\n", "not found"),
    ("model_executor/warmup/minimax_m3_msa_warmup.py", None, "not found"),
    ("v1/structured_output/backend_guidance.py",
     edits._SPDX + "from __future__ import annotations\nLazyLoader(\n", "edit not needed"),
])
def test_an_edit_whose_target_changed_stops_the_build(path, text, why):
    files = sources(**{path: text})
    with pytest.raises(edits.EditError, match=why) as err:
        edits.apply(files, "0.34.0")
    assert "vLLM 0.34.0, edit " in str(err.value)


def test_a_release_without_edits_is_refused():
    with pytest.raises(edits.EditError, match="no edits are defined for vLLM 0.99.0"):
        edits.apply(sources(), "0.99.0")


def test_wheel_lookup_and_package_description(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.whl",
                 "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl"):
        (tmp_path / "sub" / name).write_bytes(b"")
    assert builder.find_wheel([tmp_path], "pydantic-core", "2.50.5").name.startswith(
        "pydantic_core-2.50.5")
    assert builder.find_wheel([tmp_path], "pydantic-core", "2.50.4") is None
    assert builder.find_wheel([tmp_path], "vllm", "0.34.0") is not None
    d = builder.describe({"zmq/__init__.py": b"", "zmq/backend/_zmq.abi3.so": b"",
                          "pyzmq.libs/libzmq.so.5": b"", "pyzmq-27.3.0.dist-info/METADATA": b""},
                         "27.3.0")
    assert d == {"version": "27.3.0", "top_level": ["zmq"], "compiled": True}
    assert not builder.describe({"typing_extensions.py": b""}, "4.16.0")["compiled"]
    assert builder.describe({"typing_extensions.py": b""}, "4.16.0")["top_level"] == [
        "typing_extensions"]
    assert builder.DEP_SKIP.search("openai/tests/test_x.py")
    assert builder.DEP_SKIP.search("pydantic_core/core_schema.pyi")
    assert not builder.DEP_SKIP.search("transformers/testing_utils.py")


STAND_IN_CHECK = """
import sys, torch, torch.nn.functional as F
sys.path.insert(0, sys.argv[1])
import vllm_c_stand_in as s
assert set(s.REGISTERED) == set(s.OPS), s.REGISTERED
g = torch.Generator().manual_seed(0)
x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
out = torch.empty(5, 32, dtype=torch.bfloat16)
torch.ops._C.silu_and_mul(out, x)
assert torch.equal(out, F.silu(x[:, :32]) * x[:, 32:])
torch.ops._C.gelu_and_mul(out, x)
assert torch.equal(out, F.gelu(x[:, :32]) * x[:, 32:])
w = (1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16)
r = torch.randn(5, 64, generator=g).to(torch.bfloat16)
def ref(v):  # vLLM's RMSNorm.forward_static: fp32 statistics, the input dtype out
    f = v.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(v.dtype) * w
o = torch.empty_like(x)
torch.ops._C.rms_norm(o, x, w, 1e-6)
assert torch.equal(o, ref(x))
xi, ri = x.clone(), r.clone()
torch.ops._C.fused_add_rms_norm(xi, ri, w, 1e-6)
assert torch.equal(ri, x + r) and torch.equal(xi, ref(x + r))
print("ok")
"""


def test_stand_in_ops_compute_what_vllms_kernels_compute():
    proc = subprocess.run([sys.executable, "-c", STAND_IN_CHECK, str(GPU)], capture_output=True,
                          text=True, timeout=300, env=clean_env())
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


# -- with vLLM's wheel ----------------------------------------------------------

@pytest.mark.parametrize("release", ["0.34.0", "0.26.0"])
def test_edits_apply_to_the_release(release):
    files = builder.vllm_files(vllm_wheel(release), release)
    done = edits.apply(files, release)
    assert len(done) == len(edits.EDITS[release])
    for e in done:
        print(f"{release} {e['edit']}: {e['file']}")
    assert "_C_stable_libtorch.py" in files
    marked = [n for n, d in files.items() if edits.MARK.encode() in d]
    assert "model_executor/models/qwen3_next.py" in marked
    for name in marked:
        compile(files[name], name, "exec")


def test_bundle_engine_path_imports_with_the_image_and_the_bundle_alone(tmp_path):
    """The whole bundle (unpacked, no archive) and its import check under the
    guard: a package the GPU image lacks resolves from the bundle or not at
    all; its compiled packages, built for the image's Python 3.12, are
    replaced by this Python's build of the same version.  Negative control:
    without msgspec in the bundle, the engine path does not import."""
    vllm_wheel()
    missing = [f"{d}=={v}" for d, v in builder.DEPS["0.34.0"]
               if builder.find_wheel(caches(), d, v) is None]
    if missing:
        pytest.skip(f"dependency wheels not cached: {missing[:4]}")
    out = tmp_path / "bundle"
    m = builder.build("0.34.0", caches(), out, allow_download=False, directory=True)
    assert {e["edit"] for e in m["edits"]} == {e.name for e in edits.EDITS["0.34.0"]}
    assert m["packages"]["pyzmq"]["compiled"] and m["packages"]["pyzmq"]["top_level"] == ["zmq"]
    site = out / "site"
    assert not list(site.glob("vllm/**/*.so")) and (site / "vllm-0.34.0.dist-info").is_dir()
    ep = (site / "vllm_layerwise_patch-0.1.0.dist-info" / "entry_points.txt").read_text()
    assert "[vllm.general_plugins]" in ep

    def check(name: str) -> dict:
        proc = subprocess.run([sys.executable, str(GPU / "bundle_import_check.py"), str(site),
                               "--guard", "--json", str(tmp_path / name)], capture_output=True,
                              text=True, timeout=600, env=clean_env(), cwd=tmp_path)
        res = json.loads((tmp_path / name).read_text())
        res["returncode"], res["log"] = proc.returncode, proc.stdout[-3000:] + proc.stderr[-3000:]
        return res

    ok = check("imports.json")
    assert ok["returncode"] == 0 and ok["passed"], ok["log"]
    assert ok["vllm_from"].startswith("<site>")
    assert all(ok["c_ops"].values())
    carried = {k for k, v in ok["packages"].items() if v.startswith("carried")}
    assert {"vllm", "transformers", "huggingface_hub", "pydantic", "msgspec", "zmq"} <= carried
    shutil.rmtree(site / "msgspec")
    for d in site.glob("msgspec-*.dist-info"):
        shutil.rmtree(d)
    bad = check("imports-without-msgspec.json")
    assert bad["returncode"] == 1 and not bad["passed"]
    assert any("msgspec" in r.get("error", "") for r in bad["modules"] if not r["ok"]), bad["log"]
