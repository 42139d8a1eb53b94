"""A stand-in for vLLM's compiled op library, carried by the GPU bundle as
``vllm/_C_stable_libtorch.py`` (``build_vllm_bundle.py``): test-harness code,
never part of the package.

vLLM's CUDA platform imports ``vllm._C_stable_libtorch`` unconditionally
(0.34.0 ``platforms/cuda.py:23``; 0.26.0 imports ``vllm._C``), and a few
layers look ops of the ``_C`` namespace up when they are built, whatever
``custom_ops`` says (``SiluAndMul.__init__`` takes
``torch.ops._C.silu_and_mul``; the IR op ``rms_norm``'s ``vllm_c`` provider
calls ``torch.ops._C.rms_norm``; 0.26.0's Model Runner V2 maps pinned host
memory with ``torch.ops._C.get_cuda_view_from_cpu_tensor``).  The compiled library is 89 MB and cannot
travel; this module registers torch-native versions of the ops on the engine
path under that namespace instead, with the schemas of vLLM's ``csrc``
(``out``/in-place tensors first), for every device (CompositeExplicitAutograd).
An op some real ``_C`` library already registered is left alone.

The engine checks run with ``custom_ops: ["none"]`` and the IR ops on their
native providers, so these are looked up but rarely called; they still
compute what vLLM's kernels compute (``tests/test_gpu_bundle.py`` compares
them with torch on CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_LIB = torch.library.Library("_C", "FRAGMENT")  # noqa: SIM115 - lives with the module


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    d = x.shape[-1] // 2
    out.copy_(F.silu(x[..., :d]) * x[..., d:])


def gelu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    d = x.shape[-1] // 2
    out.copy_(F.gelu(x[..., :d]) * x[..., d:])


def gelu_tanh_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    d = x.shape[-1] // 2
    out.copy_(F.gelu(x[..., :d], approximate="tanh") * x[..., d:])


def _rms(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    y = y.to(x.dtype)
    return y if weight is None else y * weight


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
             epsilon: float) -> None:
    out.copy_(_rms(x, weight, epsilon))


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                       epsilon: float) -> None:
    residual.add_(x)  # (vLLM's kernel: the sum in the input dtype, kept as residual)
    x.copy_(_rms(residual, weight, epsilon))


class _PinnedBytes:
    """A pinned host tensor's bytes as a CUDA array (``__cuda_array_interface__``):
    with unified addressing, a pinned host pointer is valid on the device."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.keep = flat  # the host memory lives as long as any view of it
        self.__cuda_array_interface__ = {"shape": (flat.numel(),), "typestr": "|u1",
                                         "data": (flat.data_ptr(), False), "version": 3}


def get_cuda_view_from_cpu_tensor(cpu_tensor: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over a pinned, contiguous CPU tensor's memory (vLLM 0.26's
    Model Runner V2 has no buffers without UVA; 0.34 runs with its
    ``NonUvaBuffer`` instead, see ``bundle_edits.no_uva``)."""
    if not (cpu_tensor.is_pinned() and cpu_tensor.is_contiguous()):
        raise ValueError("get_cuda_view_from_cpu_tensor: a pinned, contiguous CPU tensor")
    flat = cpu_tensor.reshape(-1).view(torch.uint8)
    view = torch.as_tensor(_PinnedBytes(flat), device="cuda")
    return view.view(cpu_tensor.dtype).view(cpu_tensor.shape)


#: schema (as in vLLM's csrc/torch_bindings.cpp), implementation
OPS = {
    "silu_and_mul": ("silu_and_mul(Tensor! result, Tensor input) -> ()", silu_and_mul),
    "gelu_and_mul": ("gelu_and_mul(Tensor! out, Tensor input) -> ()", gelu_and_mul),
    "gelu_tanh_and_mul": ("gelu_tanh_and_mul(Tensor! out, Tensor input) -> ()",
                          gelu_tanh_and_mul),
    "rms_norm": ("rms_norm(Tensor! result, Tensor input, Tensor? weight, float epsilon) -> ()",
                 rms_norm),
    "fused_add_rms_norm": ("fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor? weight, "
                           "float epsilon) -> ()", fused_add_rms_norm),
    "get_cuda_view_from_cpu_tensor": ("get_cuda_view_from_cpu_tensor(Tensor cpu_tensor) -> Tensor",
                                      get_cuda_view_from_cpu_tensor),
}

REGISTERED: list[str] = []
for _name, (_schema, _fn) in OPS.items():
    if hasattr(torch.ops._C, _name):  # a real _C library is loaded
        continue
    _LIB.define(_schema)
    _LIB.impl(_name, _fn, "CompositeExplicitAutograd")
    REGISTERED.append(_name)
