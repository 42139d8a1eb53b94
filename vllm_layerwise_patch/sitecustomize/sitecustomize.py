"""Opt-in PYTHONPATH bootstrap for vllm-layerwise-patch.

Use when the ``.pth`` hook cannot run (e.g. ``python -S``-like launchers or a
read-only site-packages)::

    export PYTHONPATH="$(python -m vllm_layerwise_patch sitecustomize-dir):$PYTHONPATH"

It first runs the ``sitecustomize`` that would have run without this
directory (the user's own), then the overlay bootstrap.
"""

import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
    vars().update({k: v for k, v in vars(_mod).items() if not k.startswith("__")})

try:
    from vllm_layerwise_patch.bootstrap import boot as _boot
except ImportError:  # package not importable from this interpreter
    pass
else:
    _boot()
