"""Bulk vs per-layer mamba pre-copy on real vLLM objects, synthetic state.

Builds a real ``MambaSpecDecodeGPUContext`` (``create`` +
``initialize_from_forward_context``) over GDN-shaped state tensors laid out
like vLLM's (all layers' pages in one buffer, conv then ssm per layer, padded
page stride), random-fills them, and runs vLLM's bulk ``run_fused_precopy`` on
one copy and the overlay's per-layer launches (``DeferredMambaCopy``) on
another.  Requests cover: crossing a block boundary, starting fresh
(``src_col = -1``), staying in the same block, a spec-decode token bias, and
a batch slot mapped to ``-1``.

The context is built with the installed release's own API (``create``
takes ``make_buffer`` up to 0.33 and ``forward_context`` from 0.34;
``initialize_from_forward_context`` takes the aligned-index tables from
0.32).  From 0.34 the comparison is also made with a ReplaySSM context
(``ctx.replayssm`` set to a stand-in object: vLLM then launches the
pre-copy with ``ZERO_TEMPORAL_TOKEN_BIAS=True``; the stand-in is never
called), and the case is built so that the flag changes the bytes moved.

Needs a Triton vLLM can run (a GPU, or ``TRITON_INTERPRET=1`` + the CPU shim
installed before vLLM is imported); on a CUDA build without a device the
buffers are not pinned.
"""

from __future__ import annotations

import inspect
import types
from typing import Any


class ReplaySSMStandIn:
    """Stand-in for vLLM 0.34's ``ReplaySSMModelContext`` (FlashInfer
    ReplaySSM, a CUDA-only Mamba2 path): only its presence on the context
    matters to the pre-copy (``ZERO_TEMPORAL_TOKEN_BIAS``); never called."""


def build_case(seed: int = 0, *, num_layers: int = 3, num_blocks: int = 26,
               max_reqs: int = 6, device: str = "cpu", replayssm: bool = False
               ) -> dict[str, Any]:
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker.mamba_utils import (
        MambaSpecDecodeGPUContext,
        get_conv_copy_spec,
        get_temporal_copy_spec,
    )

    gen = torch.Generator().manual_seed(seed)
    width, conv_dim, heads, kdim = 3, 40, 2, 8  # conv (3 x 40 bf16), ssm (2x8x8 fp32)
    ds = is_conv_state_dim_first()
    conv_shape = (conv_dim, width) if ds else (width, conv_dim)
    ssm_shape = (heads, kdim, kdim)
    conv_bytes = width * conv_dim * 2
    ssm_bytes = heads * kdim * kdim * 4
    page = conv_bytes + ssm_bytes + 24  # padded page, like page_size_padded
    names = [f"model.layers.{i}.linear_attn" for i in range(num_layers)]
    spec = MambaSpec(block_size=16, shapes=(conv_shape, ssm_shape),
                     dtypes=(torch.bfloat16, torch.float32), page_size_padded=page,
                     mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                     mamba_cache_mode="align")
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    raw = torch.randint(0, 256, (num_layers, num_blocks * page), dtype=torch.uint8,
                        generator=gen).to(device)
    layers = {}
    for i, name in enumerate(names):
        base = raw[i]
        conv = base.view(torch.bfloat16).as_strided(
            (num_blocks, *conv_shape),
            (page // 2, conv_shape[1], 1))
        # ssm starts conv_bytes into each page (as_strided offsets count from
        # the storage start, in fp32 elements)
        off = (base.storage_offset() + conv_bytes) // 4
        ssm = base.view(torch.float32).as_strided(
            (num_blocks, *ssm_shape), (page // 4, kdim * kdim, kdim, 1), off)
        layers[name] = types.SimpleNamespace(kv_cache=[conv, ssm])
    copy_funcs = {MambaAttentionBackendEnum.GDN_ATTN: (get_conv_copy_spec,
                                                        get_temporal_copy_spec)}
    create_params = inspect.signature(MambaSpecDecodeGPUContext.create).parameters
    create_kwargs: dict[str, Any] = dict(max_num_reqs=max_reqs,
                                         kv_cache_config=kv_cache_config,
                                         copy_funcs=copy_funcs, device=torch.device(device))
    if "forward_context" in create_params:  # vLLM >= 0.34
        create_kwargs["forward_context"] = layers
    if "make_buffer" in create_params:  # vLLM <= 0.33
        create_kwargs["make_buffer"] = lambda n, dtype: CpuGpuBuffer(
            n, dtype=dtype, device=device, pin_memory=device != "cpu")
    ctx = MambaSpecDecodeGPUContext.create(**create_kwargs)
    max_cols = 4
    block_table = torch.zeros((max_reqs, max_cols), dtype=torch.int32, device=device)
    # distinct blocks everywhere: no two requests write one block, so the
    # result does not depend on the order programs run in (and a flag that
    # changes one request's copy changes the bytes)
    assert num_blocks > max_reqs * max_cols, "the case needs a block per table cell"
    ids = torch.randperm(num_blocks - 1, generator=gen)[: max_reqs * max_cols] + 1
    block_table.copy_(ids.view(max_reqs, max_cols).to(torch.int32))
    init_params = inspect.signature(ctx.initialize_from_forward_context).parameters
    tables = [[block_table], [block_table]]
    if "aligned_index_block_tables" not in init_params:  # vLLM <= 0.31
        tables = tables[:1]
    ctx.initialize_from_forward_context(kv_cache_config, layers, copy_funcs, *tables)
    if replayssm:
        assert hasattr(ctx, "replayssm"), "this vLLM has no ReplaySSM context"
        ctx.replayssm = ReplaySSMStandIn()
    # Per request slot: src (pre-advance) and dst (post-advance) columns, bias.
    #   slot 0: crosses 0 -> 1          slot 1: fresh (src -1)
    #   slot 2: same block (1 -> 1)      slot 3: crosses 1 -> 2 with bias 1
    #   slot 4: crosses 2 -> 3           slot 5: mapped out (-1 in idx_mapping)
    src = torch.tensor([0, -1, 1, 1, 2, 0], dtype=torch.int32, device=device)
    dst = torch.tensor([1, 0, 1, 2, 3, 1], dtype=torch.int32, device=device)
    bias = torch.tensor([0, 0, 0, 1, 0, 0], dtype=torch.int32, device=device)
    idx_mapping = torch.tensor([3, 0, 1, 2, 4, -1], dtype=torch.int32, device=device)
    # block_table must outlive ctx: ctx.block_table_ptrs holds its raw address
    return dict(ctx=ctx, raw=raw, block_table=block_table, layers=layers,
                kv_cache_config=kv_cache_config, copy_funcs=copy_funcs,
                names=names, state_idx=dst, src_col=src, token_bias=bias,
                idx_mapping=idx_mapping, num_reqs=6)


def run_bulk(case: dict[str, Any]) -> None:
    case["ctx"].run_fused_precopy(case["num_reqs"], case["state_idx"], case["src_col"],
                                  case["token_bias"], case["idx_mapping"])


def run_per_layer(case: dict[str, Any], layers: list[str] | None = None) -> Any:
    from ..copy_protocol import DeferredMambaCopy, layer_state_rows

    rows = layer_state_rows(case["kv_cache_config"], list(case["ctx"].mamba_group_ids),
                            case["copy_funcs"], case["layers"])
    handle = DeferredMambaCopy(ctx=case["ctx"], rows=rows, num_reqs=case["num_reqs"],
                               state_idx=case["state_idx"], src_col=case["src_col"],
                               token_bias=case["token_bias"],
                               idx_mapping=case["idx_mapping"])
    for name in (case["names"] if layers is None else layers):
        handle.copy_layer(name)
    return handle


def compare_once(seed: int = 0, *, replayssm: bool = False) -> int:
    """Raise AssertionError unless both paths leave identical bytes; return
    how many bytes the copies changed."""
    bulk = build_case(seed, replayssm=replayssm)
    per_layer = build_case(seed, replayssm=replayssm)
    before = bulk["raw"].clone()
    assert bool((before == per_layer["raw"]).all()), "cases are not identical"
    run_bulk(bulk)
    run_per_layer(per_layer)
    changed = int((bulk["raw"] != before).sum())
    assert changed > 0, "the bulk pre-copy moved nothing: the check is vacuous"
    diff = int((bulk["raw"] != per_layer["raw"]).sum())
    mode = " (ReplaySSM context)" if replayssm else ""
    assert diff == 0, f"per-layer pre-copy differs from the bulk one in {diff} bytes{mode}"
    return changed


def has_replayssm_context() -> bool:
    """True on vLLM >= 0.34 (``MambaSpecDecodeGPUContext.replayssm``)."""
    import dataclasses

    from vllm.v1.worker.mamba_utils import MambaSpecDecodeGPUContext

    return any(f.name == "replayssm" for f in dataclasses.fields(MambaSpecDecodeGPUContext))


def compare_bulk_and_per_layer(seed: int = 0) -> str:
    """Both comparisons this release needs; a one-line account of them."""
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.worker import mamba_utils as mu

    if not HAS_TRITON:  # (the kernels are stubs: say why instead of a TypeError)
        raise RuntimeError("cannot run vLLM's pre-copy kernel: vLLM found no usable Triton "
                           "backend here (Model Runner V2 will not start either)")
    moved = compare_once(seed)
    text = f"per-layer launches moved the same {moved} bytes as the bulk pre-copy"
    if has_replayssm_context():
        plain = build_case(seed)
        run_bulk(plain)
        zeroed = build_case(seed, replayssm=True)
        run_bulk(zeroed)
        flag_changes = int((plain["raw"] != zeroed["raw"]).sum())
        assert flag_changes > 0, "ZERO_TEMPORAL_TOKEN_BIAS changes nothing here: vacuous"
        moved_r = compare_once(seed, replayssm=True)
        text += (f"; with a ReplaySSM context (ZERO_TEMPORAL_TOKEN_BIAS, which changes "
                 f"{flag_changes} bytes here) {moved_r} bytes")
    kernel = mu.precopy_mamba_align_fused_kernel
    kernel = getattr(kernel, "kernel", kernel)  # bytewise-precopy-kernel's launcher
    where = getattr(getattr(kernel, "fn", kernel), "__module__", None) or "?"
    return text + f" (kernel: {where})"
