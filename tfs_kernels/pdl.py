"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start while the kernel
before it in the stream finishes; it calls :func:`gdc_wait` before it reads what that kernel wrote, and
:func:`gdc_launch_dependents` to let the next one start early. Both are no-ops without PDL. Triton builds without
them get no-op stand-ins (and :data:`HAS_GDC` False).

Rules for a kernel with a ``USE_PDL`` switch (every launch with PDL relies on all of them):
- nothing is written before ``gdc_wait`` (the kernel before may still read the memory);
- every program calls ``gdc_wait`` and only then ``gdc_launch_dependents``, and none returns before that (a
  program that exits counts as having let the next kernel launch). One exception: at one query token the split-K
  merge lets the next kernel launch before its own wait (``MERGE_EARLY_TRIGGER`` in split_kv_merge.py);
- before ``gdc_wait`` it reads only what no kernel of the step writes (weights, the KV cache of earlier steps) or
  what was written before the kernel just before it started, when that kernel follows these rules (it waited for
  its own predecessor before it let this one launch). After the early-triggering merge: only what was written
  before the partial kernel started (the merge lets the next kernel launch once every program of the partial has
  started, hence after the kernel before the partial completed; the partial's split buffers may still be in
  flight, and no kernel reads them before its wait). A plain launch (no PDL attribute) starts after everything
  before it finished. None of this holds after a kernel that lets its dependents launch before its own wait in
  other ways (inductor's own PDL kernels, ``torch._inductor.config.triton.enable_pdl``, which we do not turn on).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfs_kernels.dispatch import INTERPRET  # the interpreter cannot run the wait's inline PTX

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


@triton.jit
def prefetch_l2(ptrs):
    """Pull the 128-byte lines at ``ptrs`` (any shape; one pointer per line is enough) into L2 without waiting:
    what a kernel launched early may do with memory that the kernel before it does not write (weights, the KV
    cache of earlier steps). CUDA only (inline PTX)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


def pdl_supported(device: torch.device) -> bool:
    """True when kernels on ``device`` can be launched with PDL: a CUDA GPU of compute capability 9.0 or later and
    a Triton with grid dependency control, kernels not interpreted."""
    return HAS_GDC and not INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


__all__ = ["HAS_GDC", "gdc_launch_dependents", "gdc_wait", "pdl_supported", "prefetch_l2"]
