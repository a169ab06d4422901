"""``speculative=layer_skip``: train-free self-speculation. The target itself, run with a subset of its layers
(``exit_layer=N``: layers ``[0, N)``, early exit; or all but ``skip_layers``) plus its final norm and LM head,
drafts. Its draft K/V for the used layers live in the target's pool at the iteration's slots, where the
verification forward overwrites them; the prefix K/V it reads are the target's own."""

from __future__ import annotations

from typing import Optional

import torch

from framework.config import ConfigError, SpeculativeConfig
from framework.speculative import DRAFTERS
from framework.speculative.base import SpecContext
from framework.speculative.model_drafter import ModelDrafter


def draft_layers(num_layers: int, exit_layer: int, skip_layers: list[int]) -> tuple[int, ...]:
    """The layers the draft runs. Default (exit_layer 0, no skips): the first half."""
    if skip_layers:
        bad = [i for i in skip_layers if not 0 <= i < num_layers]
        if bad:
            raise ConfigError(f"speculative.skip_layers={skip_layers} is not allowed; layers are 0..{num_layers - 1}")
        layers = tuple(i for i in range(num_layers) if i not in set(skip_layers))
    else:
        exit_layer = exit_layer or max(1, num_layers // 2)
        if exit_layer > num_layers:
            raise ConfigError(f"speculative.exit_layer={exit_layer} is not allowed; expected 1..{num_layers}")
        layers = tuple(range(exit_layer))
    if not layers:
        raise ConfigError("speculative.skip_layers skips every layer; the draft needs at least one")
    return layers


@DRAFTERS.register("layer_skip")
class LayerSkipDrafter(ModelDrafter):
    name = "layer_skip"
    drafts_in_v2 = True  # its draft K/V go to the target's pool at the iteration's slots: no catch-up needed
    v2_by_default = True  # (its v2 iteration gives v1's tokens on a GPU: tests/test_spec_v2_gpu.py)

    def __init__(self, engine, cfg: SpeculativeConfig) -> None:
        super().__init__(engine, cfg)
        self.layer_ids = draft_layers(engine.model.args.num_layers, cfg.exit_layer, cfg.skip_layers)

    def step_forward(self, ctx: SpecContext, tokens: torch.Tensor, depth: int, col: int,
                     mask: Optional[torch.Tensor], parent_hidden: Optional[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.draft_batch(ctx, tokens, depth, col, mask)
        return self.runner.forward(batch, self.layer_ids, **self.forward_kwargs)
