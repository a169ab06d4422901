"""``speculative=layer_skip``: train-free self-speculation. The target itself, run with a subset of its layers
(``exit_layer=N``: layers ``[0, N)``, early exit; or all but ``skip_layers``) plus its final norm and LM head,
drafts. Its draft K/V for the used layers live in the target's pool at the iteration's slots, where the
verification forward overwrites them; the prefix K/V it reads are the target's own.

``skip_search=true``: the kept layers are searched while serving (:mod:`skip_search`), and drafts run on a
:class:`SlotDraftModel` whose layer choice is a device tensor (no recompilation when the set changes). A search
round re-drafts each request's last ``search_window`` committed tokens with every candidate set in one forward
(SWIFT's parallel drafting over the context: the window's own draft K/V at the pool's scratch rows, over the
target's K/V of the prefix before it) and scores the fraction of positions whose draft prediction equals the
token the target produced. Rounds run inside the v1 iteration, so their time is serving time.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch

from framework.batch import ForwardBatch, ForwardMode
from framework.config import ConfigError, SpeculativeConfig
from framework.kv import DUMMY_ROW
from framework.model_runner import ModelRunner
from framework.speculative import DRAFTERS
from framework.speculative.base import DraftTree, SpecContext
from framework.speculative.model_drafter import ModelDrafter
from framework.speculative.skip_model import ScoreWindow, SlotAttention, SlotDraftModel
from framework.speculative.skip_search import SkipSearch


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


def initial_layers(num_layers: int, cfg: SpeculativeConfig) -> list[int]:
    """The search's first set: exit_layer / skip_layers when given, else the first, the last and evenly spaced
    layers between them, ``num_layers - round(num_layers * skip_ratio)`` in all."""
    if cfg.exit_layer or cfg.skip_layers:
        return list(draft_layers(num_layers, cfg.exit_layer, cfg.skip_layers))
    keep = max(1, num_layers - round(num_layers * cfg.skip_ratio))
    if keep == 1:
        return [0]
    return sorted({round(i * (num_layers - 1) / (keep - 1)) for i in range(keep)})


@DRAFTERS.register("layer_skip")
class LayerSkipDrafter(ModelDrafter):
    name = "layer_skip"
    drafts_in_v2 = True  # its draft K/V go to the target's pool at the iteration's slots: no catch-up needed
    v2_by_default = True  # (its v2 iteration gives v1's tokens on a GPU: tests/test_spec_v2_gpu.py)

    @classmethod
    def pool_scratch_rows(cls, cfg: SpeculativeConfig) -> int:
        """skip_search: rows per layer for the scoring forward's draft K/V (a window per scored request)."""
        return cfg.search_window * cfg.search_requests if cfg.skip_search else 0

    def __init__(self, engine, cfg: SpeculativeConfig) -> None:
        super().__init__(engine, cfg)
        num_layers = engine.model.args.num_layers
        self.search: Optional[SkipSearch] = None
        if not cfg.skip_search:
            self.layer_ids = draft_layers(num_layers, cfg.exit_layer, cfg.skip_layers)
            return
        self.search = SkipSearch(num_layers, initial_layers(num_layers, cfg), cfg.seed, cfg.search_candidates,
                                 cfg.search_interval, margin=2 / (cfg.search_window * cfg.search_requests))
        self.draft_model = SlotDraftModel(engine.model, list(self.search.best))
        a, r = engine.model.args, engine.runner
        backend = SlotAttention(engine.pool, engine.allocator, a.num_heads, a.num_kv_heads, a.head_dim,
                                self.draft_model.layer_ids, cfg.search_requests)
        self.runner = ModelRunner(self.draft_model, backend, r.compiled, r.batch_sizes, engine.device,
                                  r.skip_guards, r.pdl, freeze=False, regional=r.regional)
        self.iterations = 0
        self.search_s = 0.0  # host wall time of the search rounds (inside the iterations' time)
        self.slot_copies = 0  # slot weight copies (candidates tried and switches)

    def step_forward(self, ctx: SpecContext, tokens: torch.Tensor, depth: int, col: int,
                     mask: Optional[torch.Tensor], parent_hidden: Optional[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.draft_batch(ctx, tokens, depth, col, mask)
        return self.runner.forward(batch, self.layer_ids, **self.forward_kwargs)

    def warmup(self) -> None:
        super().warmup()
        if self.search is not None and self.runner.compiled:  # the scoring forward's graph (dummy requests)
            w, n = self.cfg.search_window, self.cfg.search_requests
            self._scores([self.search.best], self._score_batch([DUMMY_ROW] * n, [w] * n), None)

    # ---- the search -------------------------------------------------------------------------------------
    def on_accept(self, ctx: SpecContext, tree: DraftTree, accept_index: list[list[int]],
                  hidden: torch.Tensor, new_roots: list[int]) -> None:
        if self.search is None:
            return
        self.iterations += 1
        if self.search.due(self.iterations):
            t0 = time.perf_counter()
            self._search_round(ctx)
            self.search_s += time.perf_counter() - t0

    def _search_round(self, ctx: SpecContext) -> None:
        """Score the current set and the round's candidates on the longest contexts of the batch; keep the best."""
        w, n = self.cfg.search_window, self.cfg.search_requests
        # committed positions [0, L) hold the target's K/V; the root (position L) is the last known token
        eligible = sorted(((L, i) for i, L in enumerate(ctx.kv_lens) if L > w), reverse=True)[:n]
        if not eligible:
            return  # no context long enough yet: due again next iteration
        picked = [ctx.reqs[i] for _, i in eligible]
        picked += [picked[0]] * (n - len(picked))
        lens = [r.kv_len for r in picked]
        seqs = [(r.prompt_ids + r.output_ids)[L - w: L + 1] for r, L in zip(picked, lens)]
        batch = self._score_batch([r.row for r in picked], lens, [s[:-1] for s in seqs])
        targets = torch.tensor([s[1:] for s in seqs], dtype=torch.int64).to(self.engine.device).reshape(-1)
        sets = [self.search.best] + self.search.propose()
        scores = self._scores(sets, batch, targets)
        self.search.record(self.iterations, sets, scores)
        self.slot_copies += self.draft_model.set_layers(list(self.search.best))

    def _score_batch(self, rows: list[int], lens: list[int], tokens: Optional[list[list[int]]] = None
                     ) -> ForwardBatch:
        """A scoring forward: request b's tokens at positions ``lens[b] - w .. lens[b] - 1``, their K/V at scratch
        row ``b``, each attending the target's prefix and the window causally."""
        w, n = self.cfg.search_window, len(rows)
        j = np.arange(w)
        lens_np = np.asarray(lens, dtype=np.int64)
        toks = np.zeros((n, w), dtype=np.int64) if tokens is None else np.asarray(tokens, dtype=np.int64)
        packed = np.stack([toks.reshape(-1), (lens_np[:, None] - w + j).reshape(-1),
                           (self.engine.pool.num_slots + np.arange(n)[:, None] * w + j).reshape(-1)])
        dev = self.engine.device
        packed_t = torch.from_numpy(packed).to(dev)
        meta = torch.from_numpy(np.stack([np.asarray(rows, dtype=np.int64), lens_np])).to(dev)
        return ForwardBatch(mode=ForwardMode.DRAFT_DECODE, input_ids=packed_t[0], positions=packed_t[1],
                            out_cache_loc=packed_t[2], req_pool_indices=meta[0], seq_lens=meta[1],
                            seq_lens_cpu=list(lens), extend_lens_cpu=[w] * n,
                            logits_index=torch.arange(n * w, device=dev), spec=ScoreWindow(w))

    @torch.inference_mode()
    def _scores(self, sets: list[tuple[int, ...]], batch: ForwardBatch,
                targets: Optional[torch.Tensor]) -> list[float]:
        """Agreement of each set's draft predictions with ``targets`` ``[n * w]`` (one host read for all). The sets
        run nearest first (fewest slots to copy from the one loaded before)."""
        order, left, loaded = [], list(range(len(sets))), tuple(self.draft_model.loaded)
        while left:
            i = min(left, key=lambda j: sum(a != b for a, b in zip(sets[j], loaded)))
            left.remove(i)
            order.append(i)
            loaded = sets[i]
        agree: dict[int, torch.Tensor] = {}
        for i in order:
            self.slot_copies += self.draft_model.set_layers(list(sets[i]))
            logits, _ = self.runner.forward(batch)
            if targets is not None:
                agree[i] = (logits.argmax(-1) == targets).float().mean()
        return torch.stack([agree[i] for i in range(len(sets))]).tolist() if agree else []

    def search_metrics(self) -> dict:
        """The kept and skipped layers now, and what the search did (for the metrics file)."""
        s = self.search
        kept = list(s.best)
        return {"kept_layers": kept, "skipped_layers": [i for i in range(s.num_layers) if i not in kept],
                "rounds": s.rounds, "switches": s.switches, "search_s": round(self.search_s, 4),
                "slot_copies": self.slot_copies, "last_round": s.last_scores}
