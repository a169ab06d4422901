"""When an op launches its Triton kernel and when it runs its plain-torch reference.

NOTE: ``TRITON_INTERPRET=1`` is read once, when this module is imported, because ``@triton.jit`` decides at
decoration time whether a kernel is compiled or interpreted. Set it in the environment before the process starts
(triton.language's own jitted helpers are decorated when triton is first imported, which torch._inductor does).

Rules (every op in ``tfs_kernels/`` follows them):
- CUDA tensors: ``torch.ops.tfs.<op>`` (the Triton kernel; torch.compile traces through it, CUDA graphs capture it).
- CPU tensors under ``TRITON_INTERPRET=1`` in eager code: ``torch.ops.tfs.<op>`` too, which runs the kernel in
  Triton's interpreter (the op has no "cpu" kernel in that mode, so the dispatcher falls through to its body).
- anything else, including CPU code being traced by torch.compile (which would trace into the op's body and fail
  for want of a GPU driver): the plain-torch reference, called directly.

This module does not import triton, so that ``attention=triton`` can refuse a CPU-only machine before triton is
imported at all.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(x: torch.Tensor) -> bool:
    """True when an op on ``x`` should launch its Triton kernel (natively or interpreted)."""
    if x.is_cuda:
        return True
    return INTERPRET and x.device.type == "cpu" and not torch.compiler.is_compiling()


def interpreter_active() -> bool:
    """True when kernels run in the Triton interpreter in this process: ``TRITON_INTERPRET=1`` was set before triton
    was imported, so that triton.language's own jitted helpers (``tl.cdiv``, ``tl.max``, ...) are interpreted too.
    Setting it later (after ``torch._inductor`` imported triton) interprets our kernels but not those helpers."""
    if not INTERPRET:
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.cdiv, InterpretedFunction)


def register_cpu_reference(op: Any, reference: Callable) -> None:
    """Make ``reference`` the op's CPU kernel, except under the interpreter (where the CPU kernel is the
    interpreted Triton kernel itself, i.e. the op's body)."""
    if not INTERPRET:
        op.register_kernel("cpu")(reference)
