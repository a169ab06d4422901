"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start while the kernel
before it in the stream finishes; it calls :func:`gdc_wait` before it reads what that kernel wrote, and
:func:`gdc_launch_dependents` to let the next one start early. Both are no-ops without PDL. Triton builds without
them get no-op stand-ins (and :data:`HAS_GDC` False)."""

from __future__ import annotations

import triton

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # an older Triton: PDL is never requested
    HAS_GDC = False

    @triton.jit
    def gdc_wait():
        """No-op stand-in (this Triton has no grid dependency control)."""
        pass

    @triton.jit
    def gdc_launch_dependents():
        """No-op stand-in (this Triton has no grid dependency control)."""
        pass


__all__ = ["HAS_GDC", "gdc_launch_dependents", "gdc_wait"]
