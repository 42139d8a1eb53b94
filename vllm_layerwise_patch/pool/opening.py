"""Opening the configured backend: LMDB (the configured path, or the default
one with this user's private fallback when another user holds it) or
Mooncake; a pool file that cannot be used leaves the engine without the
pool (or stops it, ``on_backend_unavailable='fail'``); the tests'
backend faults (:mod:`.faults`) wrap what was opened."""

from __future__ import annotations

import logging

from .backends.base import NoPool
from .config import PREFIX, PoolConfig, PoolConfigError

logger = logging.getLogger("vllm.layerwise_patch")


def _open_store(config: PoolConfig, role: str | None):
    if config.backend == "tiered":
        return _open_tiered(config, role)
    if config.backend == "mooncake":
        return _open_mooncake(config, role)
    return _open_lmdb(config)


def _open_tiered(config: PoolConfig, role: str | None):
    """The near tier (the lmdb pool of ``path``) in front of the far tier
    (Mooncake); the tests' ``tiered_fault_tier`` puts ``backend_fault`` on
    one tier only."""
    from .backends.tiered.backend import TieredBackend
    from .faults import faults

    far = _open_mooncake(config, role)
    try:
        near = _open_lmdb(config)
    except BaseException:
        far.close()
        raise
    f = faults()
    if f.backend_fault and f.tiered_fault_tier and role is not None \
            and (f.backend_fault == "lookup") == (role == "scheduler"):
        from .backends.base import FaultInjectingBackend

        if f.tiered_fault_tier == "near":
            near = FaultInjectingBackend(near, f.backend_fault)
        else:
            far = FaultInjectingBackend(far, f.backend_fault)
    # one side promotes: the scheduler, whose lookup verification reads whole
    # blocks (verify_on_lookup), else the workers, whose loads read them a
    # layer at a time - the loads then copy nothing
    promotes = role is None or (role == "scheduler") == config.verify_on_lookup
    return TieredBackend(near, far, promote=config.tiered.promote and promotes,
                         pending_blocks=config.tiered.promote_pending_blocks,
                         promote_after=config.tiered.promote_after_far_hits,
                         near_saves=config.tiered.near_saves)


def _open_mooncake(config: PoolConfig, role: str | None):
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        raise PoolConfigError(
            "kv_connector_extra_config.backend: 'mooncake' needs Mooncake Store: pip "
            "install 'vllm-layerwise-patch[mooncake]' (on CPU machines also Debian's "
            f"libibverbs1): {exc}") from exc
    from .backends.mooncake.backend import open_shared as open_mooncake

    return open_mooncake(config.mooncake, on_unavailable=config.on_backend_unavailable,
                         segment=role == "worker")


def _open_lmdb(config: PoolConfig):
    try:
        import lmdb  # noqa: F401
    except ImportError as exc:
        raise PoolConfigError(
            "kv_connector_extra_config.backend: 'lmdb' needs the lmdb package: "
            "pip install 'vllm-layerwise-patch[pool]'") from exc
    from .backends.base import PoolUnusable
    from .backends.lmdb.sharded import open_shared

    kw = {"pin_seconds": config.pin_seconds, "shared_group": config.shared_group,
          "preallocate": config.preallocate, "shards": config.shards}
    try:
        if config.path is not None:  # configured: used as it is, or refused
            return open_shared(config.path, config.capacity, **kw)
        from .directory.paths import default_path, private_fallback_path, warn_fallback
        from .directory.security import UnsafePoolPath

        path = default_path()
        try:
            return open_shared(path, config.capacity, **kw)
        except UnsafePoolPath as exc:  # someone else holds it: not a reason to stop
            fallback = private_fallback_path()
            if fallback is None:
                raise
            warn_fallback(path, fallback, exc.verdict.summary() if exc.verdict else str(exc))
            return open_shared(fallback, config.capacity, **kw)
    except PoolUnusable as exc:  # damaged, another LMDB's: serve without it
        return _without_pool(config, str(exc))


_UNUSABLE: set[str] = set()  # pools this process said it serves without


def _without_pool(config: PoolConfig, why: str):
    """A pool file that cannot be used: the engine serves without the pool
    (``on_backend_unavailable='fail'``: it does not start).  The file is left
    as it is - it is the user's, and other engines may still use it."""
    if config.on_backend_unavailable == "fail":
        raise PoolConfigError(f"{PREFIX}.path: {why} (on_backend_unavailable='fail'; "
                              "'recompute' starts the engine without the pool)")
    if why not in _UNUSABLE:  # (the scheduler and a worker may share a process)
        _UNUSABLE.add(why)  # (the message names the file)
        logger.error("vllm-layerwise-patch pool: %s; this engine serves without the pool "
                     "(no lookups, no saves) - the file is left as it is: move it aside or "
                     "delete it, or set path to another directory, and restart", why)
    return NoPool(why)


def open_backend(config: PoolConfig, fault_role: str | None = None):
    """The configured backend (``fault_role``: this side, "scheduler" or
    "worker"; the tests' backend_fault (.faults) applies to its operations)."""
    backend = _open_store(config, fault_role)
    from .faults import faults

    if isinstance(backend, NoPool):
        return backend
    fault = faults().backend_fault
    if fault and fault_role is not None and (fault == "lookup") == (fault_role == "scheduler") \
            and not (config.backend == "tiered" and faults().tiered_fault_tier):
        from .backends.base import FaultInjectingBackend

        return FaultInjectingBackend(backend, fault)
    return backend
