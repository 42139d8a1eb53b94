"""vllm-layerwise-patch: a pip-installable overlay that lets stock vLLM serve
hybrid linear-attention models from a layerwise external KV pool on Model
Runner V2.

Importing this package imports no vLLM module.  Public API:

* :func:`activate` / :func:`deactivate` - turn the overlay on/off in this
  process (normally done for you by ``VLLM_LAYERWISE_PATCH``);
* :func:`status` - what happened to each patch in this process.
"""

__version__ = "0.1.0"


def activate(selection=None):
    """Enable patches (``selection`` as in ``VLLM_LAYERWISE_PATCH``)."""
    from .activation import activate as _activate

    return _activate(selection)


def deactivate():
    """Revert every applied patch in this process."""
    from .activation import deactivate as _deactivate

    _deactivate()


def status():
    """``{patch_id: {...}}`` for this process."""
    from .activation import status as _status

    return _status()


__all__ = ["activate", "deactivate", "status", "__version__"]
