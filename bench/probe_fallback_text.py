"""How long inductor's implicit-fallback log text gets without kernels/inductor_fallbacks.py's registration: compiles
tests/test_inductor_fallbacks.py's chain (N opaque layers, each output fed twice to the next, then an op met only at
the end) with inductor's caches off and prints, for each op inductor makes a fallback for, the length of the text it
formats for its log line and the time that took. Torch <= 2.12 formats it eagerly; torch 2.13 does not call it.

    python bench/probe_fallback_text.py [N ...]    (default 4 8 12 16; on torch 2.11, 16 takes about a minute)
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch._inductor.config
import torch._inductor.exc as exc
from torch._inductor.lowering import lowerings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.test_inductor_fallbacks import _chain  # noqa: E402  (defines the two opaque test ops)

_format = exc.OperatorIssue.operator_str


def _timed(target, args, kwargs) -> str:
    start = time.perf_counter()
    text = _format(target, args, kwargs)
    print(f"  {target}: {len(text)} characters in {time.perf_counter() - start:.2f} s", flush=True)
    return text


if __name__ == "__main__":
    exc.OperatorIssue.operator_str = staticmethod(_timed)
    for n in [int(a) for a in sys.argv[1:]] or [4, 8, 12, 16]:
        print(f"{n} layers (torch {torch.__version__}):", flush=True)
        for op in (torch.ops.tfs.test_fallback_layer.default, torch.ops.tfs.test_fallback_tail.default):
            lowerings.pop(op, None)  # as before any registration: inductor takes its implicit path
        with torch._inductor.config.patch(force_disable_caches=True):
            torch.compile(_chain, fullgraph=True)(torch.randn(2, 4) / 8, [torch.randn(4) / 8 for _ in range(n)])
