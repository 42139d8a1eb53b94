"""Triton kernels shipped by the overlay.

Kept import-light: importing this package imports neither Triton nor vLLM.
Kernel modules (``bytewise_precopy``) import Triton at their top level and are
imported only by the patch that installs them, when it applies.
"""

__all__ = ["bytewise_precopy"]
