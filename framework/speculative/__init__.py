"""Drafters for speculative decoding, chosen by ``speculative=<name>`` (the registry name = the option name)."""

from __future__ import annotations

from framework.registry import Registry

DRAFTERS: Registry = Registry("drafter", lazy={
    "ngram": "framework.speculative.ngram",
    "suffix": "framework.speculative.suffix",
    "layer_skip": "framework.speculative.layer_skip",
    "draft_model": "framework.speculative.draft_model",
    "eagle": "framework.speculative.eagle",
    "mtp": "framework.speculative.mtp",
})


@DRAFTERS.register("none")
def _no_drafter(*args, **kwargs) -> None:
    """Plain decoding: one target forward per token."""
    return None


__all__ = ["DRAFTERS"]
