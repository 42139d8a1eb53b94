"""What a worker learns about its own process: its tensor-parallel rank, and
whether the overlay's layerwise patches are applied here (else the bulk
path)."""

from __future__ import annotations

from ..config import PoolConfigError

LAYERWISE_PATCHES = ("deferred-mamba-precopy", "gdn-layer-hooks")


def layerwise_patches_applied() -> tuple[bool, str]:
    try:
        from ...registry import process_is_applied

        missing = [p for p in LAYERWISE_PATCHES if not process_is_applied(p)]
    except Exception as exc:  # pragma: no cover - defensive
        return False, f"overlay registry unavailable ({exc})"
    if missing:
        return False, "overlay patch(es) not applied in this process: " + ", ".join(missing)
    return True, "overlay patches applied"


def resolve_tp_rank(tp_size: int) -> int:
    """This worker's TP rank; with TP > 1 an unresolvable rank is a startup
    error (ranks would overwrite each other's pages)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception as exc:
        if tp_size > 1:
            raise PoolConfigError(
                f"LayerwisePoolConnector: cannot tell this worker's tensor-parallel rank "
                f"(TP size {tp_size}): {type(exc).__name__}: {exc}") from None
        return 0
