"""Attention backends over the paged KV pool, chosen by ``attention=<name>``.

Adding a backend is one file with ``@ATTENTION_BACKENDS.register("<name>")`` plus ``conf/attention/<name>.yaml``
(and one line in ``_LAZY`` below so the name is known before its module is imported).
"""

from typing import Any

from framework.attention.base import AttentionBackend
from framework.errors import ConfigError
from framework.registry import Registry

_LAZY = {
    "sdpa": "framework.attention.sdpa",
    "triton": "framework.attention.triton",
    "flex": "framework.attention.flex",
    "nsa": "framework.attention.nsa",
}

ATTENTION_BACKENDS: Registry[AttentionBackend] = Registry("attention backend", lazy=_LAZY)


def build_backend(name: str, pool: Any, allocator: Any, args: Any) -> AttentionBackend:
    """The backend ``name`` over ``pool`` for a model with ``args`` (num_heads, num_kv_heads, head_dim); an MLA
    pool (DeepSeek-V3.2 family) needs a backend with MLA and indexer support."""
    from framework.kv import MLAPool

    factory = ATTENTION_BACKENDS.get(name)
    mla = isinstance(pool, MLAPool)
    if mla and not getattr(factory, "supports_mla", False):
        allowed = [n for n in ATTENTION_BACKENDS.names() if getattr(ATTENTION_BACKENDS.get(n), "supports_mla", False)]
        kind = getattr(args, "model_type", "MLA")
        raise ConfigError(f"attention={name!r} is not allowed for an MLA model ({kind}); choose one of: "
                          f"{', '.join(allowed)}")
    if not mla and getattr(factory, "mla_only", False):
        raise ConfigError(f"attention={name!r} is not allowed for this model (it needs an MLA model such as "
                          f"model=dsa_tiny); choose one of: sdpa, flex, triton")
    return factory(pool, allocator, args.num_heads, args.num_kv_heads, args.head_dim)


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "build_backend"]
