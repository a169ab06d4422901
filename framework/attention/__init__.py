"""Attention backends over the paged KV pool, chosen by ``attention=<name>``.

Adding a backend is one file with ``@ATTENTION_BACKENDS.register("<name>")`` plus ``conf/attention/<name>.yaml``
(and one line in ``_LAZY`` below so the name is known before its module is imported).
"""

from framework.attention.base import AttentionBackend
from framework.registry import Registry

_LAZY = {
    "sdpa": "framework.attention.sdpa",
    "triton": "framework.attention.triton",
    "flex": "framework.attention.flex",
}

ATTENTION_BACKENDS: Registry[AttentionBackend] = Registry("attention backend", lazy=_LAZY)

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend"]
