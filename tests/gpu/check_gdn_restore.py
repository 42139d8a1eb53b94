"""vLLM's gated-delta-rule prefill kernel restores exactly from a pool page.

    python tests/gpu/check_gdn_restore.py --vllm-src DIR [--json FILE] [--dry-run]

Runs ``chunk_gated_delta_rule`` of the release under ``DIR`` (its
``vllm/third_party/flash_linear_attention`` Triton kernels, imported from the
sources by ``vllm_sources``; with ``VLLM_TRITON_FORCE_FIRST_CONFIG=1``, vLLM's
own switch that skips autotuning, set by ``run_gpu_checks.sh``) on one
sequence of ``--tokens`` tokens, called as vLLM's GDN layer calls it
(varlen ``cu_seqlens``, ``use_qk_l2norm_in_kernel=True``, a zero initial state
for a new request, the final state returned), for an fp32 and a
low-precision (bf16; fp16 in the CPU dry run, whose interpreter mishandles
bf16) state cache:

* **one pass** over all tokens, ``--repeats`` times: the kernel's run-to-run
  variation (outputs and final state against the first run);
* **chunked through vLLM's cache** (what vLLM's own prefix cache does): the
  first ``k`` tokens, the final state written into the ssm part of a state
  page (``state.to(cache dtype)``, as vLLM stores it) laid out as vLLM's
  (conv state, then ssm state, padded), then the remaining tokens from that
  page;
* **through the pool**: the same page saved by the pool's ``SaveQueue``
  (device -> pinned host, value header and checksum) into the embedded LMDB
  backend, loaded by ``LayerwisePipeline`` into another page, and the
  remaining tokens from the loaded page.

``k`` is at block boundaries (``--block`` tokens per block).  Checks: the
loaded page equals the saved one byte for byte; the pool restore gives
outputs and final state bit-identical to the chunked run through vLLM's
cache; a zeroed state changes the outputs after ``k`` (the state matters:
a negative control).  Reported, and with an fp32 state checked: the chunked
run against the one pass (bit-exact, or within the run-to-run variation).
With a bf16 state the chunked run rounds the state at ``k`` (vLLM's HBM prefix
cache does the same), so it is compared with the one pass but not required to
equal it.  ``--extra-split`` adds a ``k`` that is not a multiple of the
kernel's 64-token chunk (reported only).

Exit 0: every check passed; 1: a check failed; 2: setup error.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_common  # noqa: E402
import vllm_sources  # noqa: E402

NS = b"gpu-check-gdn-ns"


def compare(a, b) -> dict:
    """Bit equality and the largest difference of two tensors."""
    a32, b32 = a.float(), b.float()
    same = bool(a.shape == b.shape and a.dtype == b.dtype and
                (a.reshape(-1).view(torch_int(a)) == b.reshape(-1).view(torch_int(b))).all())
    d = (a32 - b32).abs()
    return {"bit_identical": same, "max_abs_diff": float(d.max()),
            "differing_elements": int((a32 != b32).sum()), "elements": a.numel(),
            "max_abs_value": float(b32.abs().max())}


def torch_int(t):
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


class StatePages:
    """One GDN layer's state pages as vLLM lays them out: per block, the conv
    state (``width x conv_dim`` in the model dtype), then the ssm state
    (``H x V x K`` in the state dtype), the page padded."""

    def __init__(self, dev, blocks: int, heads: int, dim: int, dtype, state_dtype) -> None:
        import torch

        self.width, self.conv_dim = 3, 3 * heads * dim  # q, k, v channels
        self.conv_bytes = self.width * self.conv_dim * torch.tensor([], dtype=dtype).element_size()
        self.ssm_shape = (heads, dim, dim)
        esz = torch.tensor([], dtype=state_dtype).element_size()
        self.ssm_bytes = heads * dim * dim * esz
        self.page_bytes = (self.conv_bytes + self.ssm_bytes + 63) // 64 * 64 + 64
        self.state_dtype = state_dtype
        gen = torch.Generator(device=dev).manual_seed(3)
        self.raw = torch.randint(0, 256, (blocks, self.page_bytes), dtype=torch.uint8,
                                 device=dev, generator=gen)

    def page(self, block: int):
        """The page's bytes: what the pool stores for (layer, block)."""
        return self.raw[block]

    def ssm(self, block: int):
        b = self.raw[block, self.conv_bytes:self.conv_bytes + self.ssm_bytes]
        return b.view(self.state_dtype).view(self.ssm_shape)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-src", required=True, type=Path)
    ap.add_argument("--json")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny")
    ap.add_argument("--tokens", type=int, default=2560)
    ap.add_argument("--block", type=int, default=640, help="tokens per hybrid block")
    ap.add_argument("--split-blocks", default="1,3", help="k, in blocks")
    ap.add_argument("--extra-split", type=int, default=1000,
                    help="a k (tokens) off the 64-token chunk grid, reported only (0: none)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pool-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    a = ap.parse_args()
    if a.dry_run:
        a.tokens, a.block, a.split_blocks, a.extra_split = 256, 64, "1,3", 100
        a.heads, a.head_dim, a.repeats = 2, 64, 2
    dev = gpu_common.device(a.dry_run)
    if dev is None:
        print("RESULT: SETUP ERROR - no CUDA device (use --dry-run on CPU)")
        return 2
    global torch
    import torch
    import torch.nn.functional as F

    if dev.type == "cpu":
        # vllm.triton_utils accepts Triton only with an active driver: the
        # interpreter-only "cpu" backend stand-in of the CPU emulation
        from vllm_layerwise_patch.cpu_emulation.cpu_v2 import install_cpu_v2_shim

        install_cpu_v2_shim()
    vllm_sources.use(a.vllm_src)
    release = vllm_sources.version(a.vllm_src)
    forced = vllm_sources.force_first_config()
    from vllm.third_party.flash_linear_attention.ops import chunk_gated_delta_rule

    if dev.type == "cpu":
        vllm_sources.patch_interpreter_aliases()
    from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
    from vllm_layerwise_patch.pool.keys import STATE, marker_key, page_key
    from vllm_layerwise_patch.pool.worker.pipeline import LayerwisePipeline
    from vllm_layerwise_patch.pool.worker.send_thread import SaveQueue

    dtype = torch.float16 if dev.type == "cpu" else torch.bfloat16
    low = dtype
    N, H, D = a.tokens, a.heads, a.head_dim
    print(f"GDN restore, vLLM {release} chunk_gated_delta_rule, {dev}, {N} tokens, "
          f"{H} heads x {D}, inputs {dtype}, autotune "
          f"{'off (first config)' if forced else 'on'}", flush=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    q, k, v = (r(1, N, H, D).to(dtype) for _ in range(3))
    # as vLLM's GDN computes them: g = -exp(A_log) * softplus(a + dt_bias)
    # (fp32, log space), beta = sigmoid(b); slow decay so the state carries
    g = -torch.exp(torch.full((H,), -4.0, device=dev)) * F.softplus(r(1, N, H))
    beta = torch.sigmoid(r(1, N, H)).to(dtype)

    def run(lo: int, hi: int, h0):
        cu = torch.tensor([0, hi - lo], dtype=torch.int32, device=dev)
        o, ht = chunk_gated_delta_rule(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi],
                                       beta[:, lo:hi], initial_state=h0,
                                       output_final_state=True, cu_seqlens=cu,
                                       use_qk_l2norm_in_kernel=True)
        gpu_common.sync(dev)
        return o.clone(), ht.clone()

    checks = gpu_common.Checks()
    splits = [int(x) * a.block for x in a.split_blocks.split(",")]
    result: dict = {"vllm_release": release, "autotune": "first config" if forced else "on",
                    "tokens": N, "block": a.block, "heads": H, "head_dim": D,
                    "input_dtype": str(dtype), "runs": []}
    pool_dir = tempfile.mkdtemp(prefix="vlp-gpu-gdn-",
                                dir=gpu_common.pool_root(a.pool_dir, 300 << 20))
    backend = LmdbBackend(pool_dir, 256 << 20, pin_seconds=0)
    saver = SaveQueue(backend, NS)
    layer = "model.layers.0.linear_attn"
    pipe = LayerwisePipeline([layer], backend, NS, prefetch=1, threads=1)

    def one_state_dtype(state_dtype, sname: str) -> None:
        """The runs and checks of one state cache dtype."""
        pages = StatePages(dev, 4, H, D, dtype, state_dtype)
        h0 = torch.zeros(1, H, D, D, dtype=state_dtype, device=dev)
        ref_o, ref_h = run(0, N, h0)
        rr = [{"output": compare(o, ref_o), "final_state": compare(h, ref_h)}
              for o, h in (run(0, N, h0) for _ in range(a.repeats - 1))]
        rr_o = max((x["output"]["max_abs_diff"] for x in rr), default=0.0)
        rr_h = max((x["final_state"]["max_abs_diff"] for x in rr), default=0.0)
        rr_bits = all(x["output"]["bit_identical"] and x["final_state"]["bit_identical"]
                      for x in rr)
        print(f"  state {sname}: one pass x{a.repeats}: run-to-run "
              f"{'bit-identical' if rr_bits else f'max diff {rr_o:.3g} / {rr_h:.3g}'}",
              flush=True)
        for ks in splits + ([a.extra_split] if a.extra_split else []):
            on_grid = ks in splits
            o1, hk = run(0, ks, h0)
            # vLLM's cache: the state written into block 1's page, in the cache dtype
            pages.ssm(1).copy_(hk[0].to(state_dtype))
            o2_hbm, h_hbm = run(ks, N, pages.ssm(1)[None].clone())
            # the pool: page 1 saved, loaded into page 2
            key = page_key(NS, STATE, b"blk%d" % ks, 0, "0")
            saver.submit([(key, pages.page(1))], dev)
            assert saver.commit([marker_key(NS, STATE, b"blk%d" % ks, 0)]), "save failed"
            pages.raw[2].zero_()
            pipe.start({layer: [(key, [pages.page(2)])]})
            pipe.wait(layer)
            gpu_common.sync(dev)
            page_same = bool(torch.equal(pages.page(2), pages.page(1)))
            o2_pool, h_pool = run(ks, N, pages.ssm(2)[None].clone())
            o2_zero, _ = run(ks, N, torch.zeros_like(h0))
            split_o = torch.cat([o1, o2_hbm], dim=1)
            row = {"state_dtype": sname, "k": ks, "k_on_block_boundary": on_grid,
                   "page_bytes": pages.page_bytes,
                   "page_round_trip_identical": page_same,
                   "pool_vs_hbm_chunked": {"output": compare(o2_pool, o2_hbm),
                                           "final_state": compare(h_pool, h_hbm)},
                   "chunked_vs_one_pass": {"output": compare(split_o, ref_o),
                                           "final_state": compare(h_hbm, ref_h)},
                   "zero_state_vs_one_pass_after_k": compare(o2_zero, ref_o[:, ks:]),
                   "run_to_run_one_pass": {"bit_identical": rr_bits,
                                           "max_abs_diff_output": rr_o,
                                           "max_abs_diff_final_state": rr_h}}
            result["runs"].append(row)
            label = f"state {sname}, k={ks}"
            if not on_grid:
                c = row["chunked_vs_one_pass"]
                print(f"  info {label} (off the 64-token chunk grid): chunked vs one pass "
                      f"output max diff {c['output']['max_abs_diff']:.3g}, final state "
                      f"{c['final_state']['max_abs_diff']:.3g}", flush=True)
                continue
            checks.check(f"{label}: page round trip through the pool is byte-identical",
                         page_same, f"{pages.page_bytes} bytes")
            pv = row["pool_vs_hbm_chunked"]
            checks.check(f"{label}: pool restore == chunked run through vLLM's cache "
                         "(outputs and final state, bit for bit)",
                         pv["output"]["bit_identical"] and pv["final_state"]["bit_identical"],
                         f"max diff {pv['output']['max_abs_diff']:.3g} / "
                         f"{pv['final_state']['max_abs_diff']:.3g}")
            z = row["zero_state_vs_one_pass_after_k"]
            checks.check(f"{label}: negative control - a zeroed state changes the outputs",
                         not z["bit_identical"] and z["max_abs_diff"] > 0,
                         f"max diff {z['max_abs_diff']:.3g}")
            c = row["chunked_vs_one_pass"]
            exact = c["output"]["bit_identical"] and c["final_state"]["bit_identical"]
            within = (c["output"]["max_abs_diff"] <= rr_o
                      and c["final_state"]["max_abs_diff"] <= rr_h)
            detail = ("bit-identical" if exact else
                      f"output max diff {c['output']['max_abs_diff']:.3g} "
                      f"({c['output']['differing_elements']} of {c['output']['elements']}), "
                      f"final state {c['final_state']['max_abs_diff']:.3g} (run-to-run "
                      f"{rr_o:.3g} / {rr_h:.3g})")
            if state_dtype == torch.float32:
                checks.check(f"{label}: chunked == one pass (bit-exact or within run-to-run "
                             "variation)", exact or within, detail)
            else:
                print(f"  info {label}: chunked vs one pass: {detail} (the state is "
                      f"rounded to {sname} at k, as in vLLM's own cache)", flush=True)

    try:
        for state_dtype in (torch.float32, low):
            sname = str(state_dtype).replace("torch.", "")
            try:
                one_state_dtype(state_dtype, sname)
            except Exception as exc:  # noqa: BLE001 - recorded; the other dtype still runs
                checks.error(f"state {sname}: the runs completed", exc)
            result["checks"], result["passed"] = checks.rows, checks.passed
            gpu_common.write_json(a.json, "gdn_restore", result)
    finally:
        pipe.close()
        saver.close()
        backend.close()
        shutil.rmtree(pool_dir, ignore_errors=True)
    print(f"RESULT: {'PASS' if checks.passed else 'FAIL'}")
    return checks.exit_code()


if __name__ == "__main__":
    sys.exit(main())
