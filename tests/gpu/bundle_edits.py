"""The edits ``build_vllm_bundle.py`` applies to the carried copy of vLLM (and
only there): test-harness code that lets a release's Python sources run an
engine on a GPU machine without vLLM's compiled modules.  The package never
ships or needs them; a user's real vLLM runs the same checks unchanged
(``check_engine.py --real-vllm``).

Each edit is a function with a docstring saying the file, what it changes and
why.  It changes text it finds exactly once and raises :class:`EditError`
when that text is not there (or is there more than once), so that a new
release is never edited silently in the wrong place.  ``EDITS[release]`` is
the list applied to that release; ``apply(files, release)`` runs them on
``{path under vllm/: bytes}`` and returns one record per edit.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: the bundle's marker in every edited line (grep for it in the carried tree)
MARK = "# [gpu-bundle edit]"


class EditError(RuntimeError):
    """An edit's target text is missing or ambiguous: the release changed."""


def replace_once(files: dict[str, bytes], path: str, old: str, new: str) -> None:
    """Replace the one occurrence of ``old`` in ``path`` with ``new``."""
    if path not in files:
        raise EditError(f"{path}: not in the release's sources")
    text = files[path].decode()
    n = text.count(old)
    if n != 1:
        first = old.strip().splitlines()[0] if old.strip() else old
        raise EditError(f"{path}: expected the edit's target once, found it {n} times: "
                        f"{first!r}")
    files[path] = text.replace(old, new).encode()


def require(files: dict[str, bytes], path: str, text: str) -> None:
    """``path`` must contain ``text`` (what makes the edit necessary)."""
    if path not in files or text not in files[path].decode():
        raise EditError(f"{path}: {text!r} not found")


# -- the edits ---------------------------------------------------------------

def c_stand_in(files: dict[str, bytes]) -> None:
    """File: ``vllm/_C_stable_libtorch.py`` (new).
    What: a Python module of that name (``vllm_c_stand_in.py``) that registers
    torch-native ``silu_and_mul``, ``gelu_and_mul``, ``rms_norm``,
    ``fused_add_rms_norm`` under ``torch.ops._C``, and
    ``get_cuda_view_from_cpu_tensor`` (a CUDA view of pinned host memory
    through ``__cuda_array_interface__``; only 0.26.0 calls it).
    Why: ``platforms/cuda.py`` imports the compiled ``vllm._C_stable_libtorch``
    (89 MB, left behind) unconditionally, and ``SiluAndMul.__init__`` looks up
    ``torch.ops._C.silu_and_mul`` on CUDA whatever ``custom_ops`` says."""
    require(files, "platforms/cuda.py", "import vllm._C_stable_libtorch")
    if "_C_stable_libtorch.py" in files:
        raise EditError("_C_stable_libtorch.py: the release has one already")
    files["_C_stable_libtorch.py"] = (HERE / "vllm_c_stand_in.py").read_bytes()


def no_uva(files: dict[str, bytes]) -> None:
    """File: ``vllm/utils/platform_utils.py``, ``is_uva_available``.
    What: answer False.
    Why: Model Runner V2's UVA buffers (``v1/worker/gpu/buffer_utils.py``)
    map pinned host memory with the compiled
    ``torch.ops._C.get_cuda_view_from_cpu_tensor``; without UVA they use
    their ``NonUvaBuffer`` fallback (explicit host-to-device copies)."""
    replace_once(files, "utils/platform_utils.py",
                 "    return is_pin_memory_available() and not "
                 "current_platform.is_confidential_compute()\n",
                 f"    return False  {MARK} no compiled UVA view op: NonUvaBuffer\n")


def noop_minimax_warmup(files: dict[str, bytes]) -> None:
    """File: ``vllm/model_executor/warmup/minimax_m3_msa_warmup.py``.
    What: the module becomes one no-op ``minimax_m3_msa_warmup(worker)``.
    Why: ``kernel_warmup`` imports it on every CUDA engine start, and it
    imports MiniMax-M3's CUTLASS/CuTe-DSL modules (``cutlass``, ``quack``,
    ``cuda.bindings``: not on the GPU machine, not needed by other models)."""
    path = "model_executor/warmup/minimax_m3_msa_warmup.py"
    require(files, path, "def minimax_m3_msa_warmup(")
    require(files, "model_executor/warmup/kernel_warmup.py", "minimax_m3_msa_warmup(worker)")
    files[path] = (f'"""{MARK} a no-op: the real module imports MiniMax-M3\'s CUTLASS '
                   f'kernels."""\n\n\ndef minimax_m3_msa_warmup(worker) -> None:\n'
                   f'    return None\n').encode()


_NO_MOE_RAISE = '            raise RuntimeError("No Qwen3Next layer found in the model.layers.")\n'
_NO_MOE = (f"            {MARK} a dense-MLP config: no MoE layer, no expert kernels\n"
           "            self.num_moe_layers = 0\n"
           "            self.num_expert_groups = 1\n"
           "            self.num_shared_experts = 0\n"
           "            self.num_logical_experts = self.num_physical_experts = 0\n"
           "            self.num_local_physical_experts = self.num_routed_experts = 0\n"
           "            self.num_redundant_experts = 0\n"
           "            return\n")


def dense_qwen3_next(files: dict[str, bytes]) -> None:
    """File: ``vllm/model_executor/models/qwen3_next.py``,
    ``Qwen3NextForCausalLM.set_moe_parameters``.
    What: a model without MoE layer (``num_experts: 0``, or every layer in
    ``mlp_only_layers``) gets zero MoE parameters instead of a RuntimeError.
    Why: a MoE layer needs the compiled ``_moe_C`` (``moe_align_block_size``,
    ``topk_softmax``: no Triton fallback); the engine checks use a
    Qwen3-Next-shaped hybrid with dense MLPs, which vLLM builds layer by
    layer (``Qwen3NextMLP``) but then refuses in this one method."""
    replace_once(files, "model_executor/models/qwen3_next.py", _NO_MOE_RAISE, _NO_MOE)


_SPDX = ("# SPDX-License-Identifier: Apache-2.0\n"
         "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n")


def lazy_structured_output_annotations(files: dict[str, bytes]) -> None:
    """Files: ``vllm/v1/structured_output/backend_xgrammar.py`` and
    ``backend_guidance.py`` (line 3, after the licence header).
    What: ``from __future__ import annotations``.
    Why: their grammar dataclasses annotate fields with ``xgr.GrammarMatcher``
    and ``llguidance.LLMatcher`` through ``LazyLoader``s, which Python
    evaluates when the class is made: importing ``vllm.v1.request`` then
    imports xgrammar (and its TVM FFI, 13 MB compiled) and llguidance (7.7 MB
    compiled), which only a request with structured output uses.  With the
    annotations postponed they load when such a request comes."""
    for name in ("backend_xgrammar.py", "backend_guidance.py"):
        path = f"v1/structured_output/{name}"
        require(files, path, "LazyLoader(")
        if "from __future__ import annotations" in files[path].decode():
            raise EditError(f"{path}: already postpones its annotations (edit not needed)")
        replace_once(files, path, _SPDX,
                     _SPDX + f"from __future__ import annotations  {MARK} lazy grammar libs\n")


@dataclasses.dataclass(frozen=True)
class Edit:
    fn: Callable[[dict[str, bytes]], None]

    @property
    def name(self) -> str:
        return self.fn.__name__

    @property
    def doc(self) -> str:
        return inspect.cleandoc(self.fn.__doc__ or "")

    def part(self, label: str) -> str:
        """The docstring's ``File:``/``What:``/``Why:`` paragraph, one line."""
        text = " ".join(self.doc.split())
        start = text.find(f"{label}:")
        if start < 0:
            return ""
        end = min([i for i in (text.find(f"{x}:", start + 1)
                               for x in ("Files", "File", "What", "Why")) if i > start]
                  or [len(text)])
        return text[start + len(label) + 1:end].strip()


#: the edits per release (0.26.0: the fallback that pins torch 2.11; its V2
#: runner has no NonUvaBuffer, so it keeps UVA and the stand-in's view op)
EDITS: dict[str, list[Edit]] = {
    "0.34.0": [Edit(c_stand_in), Edit(no_uva), Edit(noop_minimax_warmup),
               Edit(dense_qwen3_next), Edit(lazy_structured_output_annotations)],
    "0.26.0": [Edit(c_stand_in), Edit(noop_minimax_warmup), Edit(dense_qwen3_next),
               Edit(lazy_structured_output_annotations)],
}


def apply(files: dict[str, bytes], release: str) -> list[dict[str, str]]:
    """Apply ``EDITS[release]`` to ``files`` in place; one record per edit."""
    if release not in EDITS:
        raise EditError(f"no edits are defined for vLLM {release} (known: {sorted(EDITS)})")
    done = []
    for edit in EDITS[release]:
        try:
            edit.fn(files)
        except EditError as exc:
            raise EditError(f"vLLM {release}, edit {edit.name}: {exc}") from None
        done.append({"edit": edit.name, "file": edit.part("File") or edit.part("Files"),
                     "what": edit.part("What"),
                     "why": edit.part("Why")})
    return done
