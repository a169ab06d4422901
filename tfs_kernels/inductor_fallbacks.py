"""Inductor lowerings for the ``tfs`` ops, registered before a compile instead of by inductor when it first meets one.

Inductor cannot look inside an opaque custom op (the ``*_pdl`` variants: ``torch.library.custom_op`` launching a
kernel with launch attributes that ``wrap_triton`` cannot express), so it lowers each to a fallback kernel call. When
an op has no lowering yet, inductor registers one on the spot ("implicit fallback"), and torch <= 2.12 first formats
the op's arguments for a log line that is off by default: ``str()`` of each argument's IR node. An external kernel's
text embeds its inputs' whole texts, so over a chain of custom ops where each layer's output feeds two ops (the next
projection and the residual), the text doubles per layer. An op first met after 32 such layers (branch step-ends'
own final-norm kernel) took longer than any timeout (2026-12-01: 2.7 M characters at 6 layers, 5.9 M at 7).
Torch 2.13 formats that line lazily; tests/test_inductor_fallbacks.py reproduces the blow-up on torch 2.11's CPU.
Registering the same fallback ahead of time skips that path; what inductor builds is unchanged (the same
``make_fallback`` call with the same layout constraint as its implicit path).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def register_inductor_fallbacks() -> list[str]:
    """Register inductor's fallback lowering for every ``tfs`` op imported so far that has none; returns their names.

    Idempotent. Ops implemented with ``triton_op`` are decomposed into their kernels before inductor lowers the graph,
    so their lowering is never looked up; registering one for them changes nothing."""
    try:  # torch internals (as in torch 2.11 and 2.13); the workaround is needed up to torch 2.12
        from torch._inductor.lowering import lowerings, make_fallback, tag_to_layout_constraint
        from torch._library.custom_ops import OPDEFS
        from torch._library.utils import get_layout_constraint_tag
    except ImportError as e:
        log.warning("tfs ops' inductor fallbacks not registered in advance (%s): inductor makes them itself", e)
        return []

    registered = []
    for name, opdef in list(OPDEFS.items()):
        op = opdef._opoverload
        if not name.startswith("tfs::") or op in lowerings:
            continue
        # as inductor's implicit fallback does for a custom op (torch/_inductor/graph.py, GraphLowering.call_function)
        constraint = tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        make_fallback(op, layout_constraint=constraint, warn=False)
        registered.append(name)
    return registered
