"""``speculative.version``: which iteration runs a drafter. v2 (:mod:`worker_v2`) keeps the whole iteration on the
device and overlaps it with the host; v1 (:mod:`worker`) drafts on the host and reads every result back.

``auto`` takes v2 for drafters whose v2 iteration has also been run on a GPU (``Drafter.v2_by_default``); the others
run v2 when asked (``speculative.version=v2``), v1 otherwise."""

from __future__ import annotations

from typing import Optional

from framework.config import SpeculativeConfig

VERSIONS = ["auto", "v1", "v2"]


def v2_unsupported(cfg: SpeculativeConfig) -> Optional[str]:
    """Why v2 cannot run this configuration, or None when it can."""
    from framework.speculative import DRAFTERS

    if cfg.adaptive and not getattr(DRAFTERS.get(cfg.name), "drafts_on_device", False):
        return f"speculative.adaptive=true runs in v2 with drafters that draft on the device (ngram), not {cfg.name}"
    if cfg.skip_search:
        return "speculative.skip_search=true searches the skip set between v1 iterations"
    if cfg.topk > 1:
        chains = getattr(DRAFTERS.get(cfg.name), "drafts_on_device", False)
        return f"speculation v2 runs chains only (topk=1), got topk={cfg.topk}" + (
            f"; {cfg.name}'s chains (speculative.topk=1 speculative.num_draft_tokens=0) run in v2, whose iteration "
            "stays on the device (on a GPU, v1's host work is on every iteration's critical path)" if chains else "")
    if not getattr(DRAFTERS.get(cfg.name), "drafts_in_v2", False):
        return (f"speculative={cfg.name} does not run in v2 (v2 runs: ngram, suffix, layer_skip, draft_model, eagle, "
                f"mtp)")
    return None


def resolve_version(cfg: SpeculativeConfig) -> tuple[str, Optional[str]]:
    """(``v1`` or ``v2``, the reason v2 was not taken where it was asked for or ``auto``)."""
    if cfg.name == "none" or cfg.version == "v1":
        return "v1", None
    reason = v2_unsupported(cfg)
    if reason is None and cfg.version == "auto":
        from framework.speculative import DRAFTERS

        if not getattr(DRAFTERS.get(cfg.name), "v2_by_default", False):
            reason = (f"speculative={cfg.name} runs v2 only when asked (speculative.version=v2) until its v2 "
                      f"iteration has been run on a GPU")
    return ("v1", reason) if reason else ("v2", None)
