"""Checks of a vLLM engine configuration that a layerwise hybrid pool needs.

Used by ``doctor --engine-args``; the pool checks read the same rules the
pool connector applies at startup (``pool.directory.security``, ``pool.identity``).  Each check is a :class:`Check` with ``ok`` True / False / None
(None: not applicable to this configuration).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any


@dataclasses.dataclass
class Check:
    name: str
    ok: bool | None
    detail: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _v2_requested() -> tuple[bool | None, str]:
    """Whether vLLM reads ``VLLM_USE_V2_MODEL_RUNNER`` as on, and why not.
    The variable is vLLM's, so vLLM's own parser decides (it takes integers
    only: a spelling ours would accept, e.g. ``true``, stops vLLM)."""
    name = "VLLM_USE_V2_MODEL_RUNNER"
    raw = os.environ.get(name)
    try:
        import vllm.envs as vllm_envs

        v2 = getattr(vllm_envs, name)
    except ImportError as exc:
        return None, f"vLLM is not importable ({exc}): cannot tell"
    except Exception as exc:
        return False, f"vLLM cannot read {name}={raw!r} ({type(exc).__name__}: {exc}): use 1"
    if v2:
        return True, f"{name}={raw}"
    return False, f"{name} is not 1: the overlay targets Model Runner V2"


def env_checks() -> list[Check]:
    """What can be told from the environment alone (no engine config)."""
    v2, detail = _v2_requested()
    out = [Check("model-runner-v2", v2, detail)]
    try:
        from vllm.triton_utils import HAS_TRITON
    except Exception:
        HAS_TRITON = None
    if HAS_TRITON is not None:
        out.append(Check(
            "triton",
            bool(HAS_TRITON) if v2 else None,
            "Triton usable by vLLM" if HAS_TRITON else
            "vLLM found no usable Triton backend: Model Runner V2 will refuse to "
            "start (on CPU-only machines see vllm_layerwise_patch.cpu_emulation)",
        ))
    return out


def _is_hybrid(vllm_config: Any) -> bool:
    mc = getattr(vllm_config, "model_config", None)
    try:
        return bool(mc is not None and mc.is_hybrid)
    except Exception:
        return False


def vllm_config_checks(vllm_config: Any, *, layerwise: bool = True) -> list[Check]:
    """Checks on a built ``VllmConfig``."""
    out: list[Check] = []
    v2 = bool(getattr(vllm_config, "use_v2_model_runner", False))
    out.append(Check("model-runner-v2", v2,
                     "Model Runner V2 in use" if v2 else
                     "V1 model runner in use: set VLLM_USE_V2_MODEL_RUNNER=1"))
    cc = vllm_config.cache_config
    pc = bool(cc.enable_prefix_caching)
    out.append(Check("prefix-caching", pc,
                     "enabled" if pc else "off: pass --enable-prefix-caching"))
    hybrid = _is_hybrid(vllm_config)
    mode = getattr(cc, "mamba_cache_mode", None)
    out.append(Check(
        "mamba-align-mode",
        (mode == "align") if hybrid else None,
        f"mamba_cache_mode={mode!r}" + ("" if hybrid else " (model is not hybrid)")
        + ("" if not hybrid or mode == "align" else
           ": hybrid hits need 'align' (prefix caching sets it)"),
    ))
    disabled = getattr(vllm_config.scheduler_config, "disable_hybrid_kv_cache_manager", None)
    out.append(Check(
        "hybrid-kv-cache-manager",
        (not disabled) if hybrid else None,
        ("on" if not disabled else
         "disabled: the connector must be SupportsHMA and "
         "--disable-hybrid-kv-cache-manager must not be set")
        + ("" if hybrid else " (model is not hybrid)"),
    ))
    mode_cg = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    full = bool(mode_cg is not None and mode_cg.has_full_cudagraphs())
    out.append(Check(
        "cudagraph-mode",
        (not full) if layerwise else None,
        f"cudagraph_mode={getattr(mode_cg, 'name', mode_cg)}"
        + (": FULL cudagraphs skip per-layer hooks; use PIECEWISE or NONE"
           if full and layerwise else ""),
    ))
    return out


POOL_CONNECTOR = "LayerwisePoolConnector"


def pool_checks(vllm_config: Any) -> list[Check]:
    """With the pool connector configured: its extra config, the pool path's
    owner, mode and verdict (nothing is created or read), and whether vLLM's
    prefix hashes can match across processes."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is None or getattr(ktc, "kv_connector", None) != POOL_CONNECTOR:
        return []
    from .pool.config import PoolConfig, PoolConfigError
    from .pool.identity.namespace import hash_seed_problem
    from .pool.directory.security import check_pool_path

    out: list[Check] = []
    try:
        cfg = PoolConfig.from_extra(ktc.kv_connector_extra_config)
    except PoolConfigError as exc:
        return [Check("pool-config", False, str(exc))]
    out.append(Check("pool-config", True, f"backend {cfg.backend}, capacity {cfg.capacity} "
                     f"bytes, {'shared with group ' + cfg.shared_group if cfg.shared_group else 'private'}"))
    try:
        if cfg.path is not None:
            verdict = check_pool_path(cfg.path, cfg.shared_group)
            out.append(Check("pool-path", verdict.ok, verdict.summary()))
        else:  # the default: held by someone else, engines use a private fallback
            from .pool.directory.paths import default_path

            verdict = check_pool_path(default_path(), cfg.shared_group)
            out.append(Check("pool-path", True, verdict.summary() + (
                "" if verdict.ok else " (the default path: engines use this user's "
                "private fallback instead, with a warning)")))
    except PoolConfigError as exc:
        out.append(Check("pool-path", False, str(exc)))
    problem = hash_seed_problem(vllm_config.cache_config)
    algo = getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256")
    out.append(Check("prefix-hash-seed", problem is None,
                     problem or f"prefix_caching_hash_algo={algo!r}: the same block hashes "
                                "in every process"))
    return out


class EngineArgsError(ValueError):
    """vLLM's argument parser refused the arguments; the message is its own."""


def _parser():
    """vLLM's ``vllm serve`` engine-argument parser, raising
    :class:`EngineArgsError` with the parser's message where argparse would
    print usage and exit."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):
        def print_usage(self, file: Any = None) -> None:
            pass  # the message says what is wrong; doctor prints it

        def exit(self, status: int = 0, message: str | None = None):
            text = (message or "").strip().removeprefix(f"{self.prog}: error: ")
            raise EngineArgsError(text or f"the parser exited with status {status}")

    return EngineArgs.add_cli_args(Parser(prog="doctor"))


def engine_args_checks(argv: list[str]) -> list[Check]:
    """Build the engine config from ``vllm serve``-style arguments and check it."""
    from vllm.engine.arg_utils import EngineArgs

    ns = _parser().parse_args(argv)
    args = EngineArgs.from_cli_args(ns)
    vc = args.create_engine_config()
    layerwise = vc.kv_transfer_config is not None
    return vllm_config_checks(vc, layerwise=layerwise) + pool_checks(vc)
