"""The engine's own host work per step that does not depend on the device: the scheduler's choice of the next step
(``Scheduler.schedule``) in a steady decode, and speculation's adaptive draft-length controller
(``DraftLengthController.choose`` + ``record``) per iteration, and ``speculative=suffix``'s drafting
(``SuffixDrafter.batch_drafts`` with conf/speculative/suffix.yaml's knobs, on synthetic text: phrases drawn from a
fixed set, some tokens at random; 300-token prompts, 3 tokens a request accepted per iteration), and its v2 chains
drafted eagerly (``suffix_chain_device`` over a full corpus ring, as the CPU runs speculation v2; and in the form
that ``suffix_device.FUSED_GRAPH`` gives compiled graphs, run eagerly), at each ``--batch`` size. Where the host limits a small model's step (SmolLM2 on a GPU), these microseconds are on the critical path.

The scheduler is timed inside a real engine (``model=tiny_llama compile=eager`` unless overridden after ``--``)
generating ``--tokens`` tokens for each of ``batch`` requests (the second of two runs, so the timed one starts warm);
the controller on synthetic feedback (every depth measured, random per-request shadow counts). Prints the median of
``--runs`` runs of microseconds per step or iteration.

    .venv/bin/python bench/step_host_cost.py --batch 8 64

On the CPU machine this runs in about 20 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Callable

import numpy as np
import torch
from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from framework import LLM  # noqa: E402
from framework.scheduler import Scheduler  # noqa: E402
from framework.request import Request  # noqa: E402
from framework.sampling import SamplingParams  # noqa: E402
from framework.speculative.adaptive import DraftLengthController, record_iteration  # noqa: E402
from framework.speculative.suffix import SuffixDrafter, resolve_auto_shape  # noqa: E402
from framework.speculative.suffix_corpus import SuffixCorpus  # noqa: E402
from framework.speculative.suffix_device import chain_limits, suffix_chain_device  # noqa: E402


def schedule_us(batch: int, tokens: int, overrides: list[str]) -> float:
    """Microseconds per ``Scheduler.schedule`` call over a generate job of ``batch`` requests."""
    spent = [0.0, 0]
    original = Scheduler.schedule

    def timed(self: Scheduler, *args, **kwargs):
        t0 = time.perf_counter()
        out = original(self, *args, **kwargs)
        spent[0] += time.perf_counter() - t0
        spent[1] += 1
        return out

    llm = LLM(["model=tiny_llama", "compile=eager", f"scheduler.max_running_requests={batch}", *overrides])
    items = [dict(prompt="a b c d e f a b c d e f a b c " * 3, max_tokens=tokens, ignore_eos=True)] * batch
    Scheduler.schedule = timed
    try:
        llm.generate(items)
        spent[:] = [0.0, 0]
        llm.generate(items)
    finally:
        Scheduler.schedule = original
        llm.close()
    return 1e6 * spent[0] / spent[1]


def controller_us(batch: int, iterations: int, depth: int = 5) -> tuple[float, float]:
    """(choose, record) microseconds per iteration of a shadow-acceptance controller at ``batch`` requests."""
    rng = np.random.default_rng(0)
    ctl, lengths, rows = DraftLengthController(depth, shadow=True), {}, list(range(batch))

    def feedback(k: int) -> tuple:
        seconds = 1e-3 * (1 + 0.1 * k) * (1 + 0.01 * rng.random())
        return batch, k, [1 + min(k, 2)] * batch, seconds, rng.integers(0, 2, size=(batch, 2 * depth)), rows

    for k in range(depth + 1):  # every depth measured twice: the steady state
        for _ in range(2):
            record_iteration(ctl, lengths, *feedback(k))
    choose = record = 0.0
    for _ in range(iterations):
        t0 = time.perf_counter()
        k = ctl.choose(batch, rows)
        t1 = time.perf_counter()
        record_iteration(ctl, lengths, *feedback(k))
        choose, record = choose + t1 - t0, record + time.perf_counter() - t1
    return 1e6 * choose / iterations, 1e6 * record / iterations


def synthetic_text(rng: np.random.Generator) -> Callable[[int], list[int]]:
    """``text(n)``: n tokens of phrases drawn from a fixed set of 40, 30% of tokens at random (a vocabulary of 200)."""
    phrases = [list(rng.integers(0, 200, size=rng.integers(3, 12))) for _ in range(40)]

    def text(n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            out += [int(t) for t in phrases[rng.integers(40)]] if rng.random() < 0.7 else [int(rng.integers(200))]
        return out[:n]

    return text


def suffix_knobs() -> dict:
    """conf/speculative/suffix.yaml's knobs, its auto shape resolved as on the CPU (trees)."""
    conf = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "conf", "speculative", "suffix.yaml"))
    knobs = SimpleNamespace(**{k: v for k, v in OmegaConf.to_container(conf).items() if k not in ("defaults", "name")})
    resolve_auto_shape(knobs, "cpu")
    return {k: v for k, v in vars(knobs).items() if k != "version"}


def chain_us(batch: int, iterations: int, fused: bool = False) -> float:
    """Microseconds per eager ``suffix_chain_device`` call (speculation v2's suffix chains drafted on the CPU) at
    ``batch`` requests of 400 known tokens, over a full corpus ring (``suffix_cache_tokens`` slots). ``fused``: in
    the form compiled graphs take with ``suffix_device.FUSED_GRAPH`` (the same drafts), run eagerly."""
    rng = np.random.default_rng(0)
    text, knobs = synthetic_text(rng), suffix_knobs()
    corpus = SuffixCorpus(knobs["suffix_cache_tokens"], torch.device("cpu"))
    while corpus.num_tokens < knobs["suffix_cache_tokens"] - 600:
        corpus.add([text(300)])
    history = torch.tensor([text(512) for _ in range(batch)])  # [batch, 512]
    lens = torch.full((batch,), 400)
    limits = torch.tensor(chain_limits(knobs["num_steps"], knobs["suffix_max_depth"], knobs["max_spec_factor"],
                                       knobs["max_spec_offset"]))
    ring, start = corpus.window()
    spent = 0.0
    for i in range(iterations + 1):
        t0 = time.perf_counter()
        suffix_chain_device(history, lens, ring, start, limits, knobs["num_steps"], knobs["min_token_prob"],
                            fused_graph=fused)
        spent += (time.perf_counter() - t0) if i else 0.0  # the first call warms up
    return 1e6 * spent / iterations


def suffix_us(batch: int, iterations: int) -> float:
    """Microseconds per ``SuffixDrafter.batch_drafts`` call (its trees' upkeep and the drafts) at ``batch``
    requests, each growing by 3 tokens an iteration."""
    rng = np.random.default_rng(0)
    text = synthetic_text(rng)
    drafter = SuffixDrafter(SimpleNamespace(device="cpu"), SimpleNamespace(**suffix_knobs()))

    reqs = [Request(rid=i, prompt_ids=text(300), params=SamplingParams(), seed=0, max_new_tokens=1 << 20)
            for i in range(batch)]
    spent = 0.0
    for _ in range(iterations):
        t0 = time.perf_counter()
        drafter.batch_drafts(reqs)
        spent += time.perf_counter() - t0
        for req in reqs:
            req.output_ids += text(3)
    return 1e6 * spent / iterations


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request of the scheduler's job")
    ap.add_argument("--iterations", type=int, default=2000, help="controller iterations per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the scheduler's engine")
    args = ap.parse_args()
    print(f"{'batch':>5}  {'schedule us/step':>16}  {'choose us':>9}  {'record us':>9}  {'suffix us':>9}"
          f"  {'chain us':>9}  {'fused form us':>13}")
    for batch in args.batch:
        sched = statistics.median(schedule_us(batch, args.tokens, args.overrides) for _ in range(args.runs))
        ctl = [controller_us(batch, args.iterations) for _ in range(args.runs)]
        choose, record = (statistics.median(c[i] for c in ctl) for i in (0, 1))
        suffix = statistics.median(suffix_us(batch, 300) for _ in range(args.runs))
        chain = statistics.median(chain_us(batch, 20) for _ in range(args.runs))
        fused = statistics.median(chain_us(batch, 20, fused=True) for _ in range(args.runs))
        print(f"{batch:>5}  {sched:>16.1f}  {choose:>9.1f}  {record:>9.1f}  {suffix:>9.1f}  {chain:>9.1f}"
              f"  {fused:>13.1f}")


if __name__ == "__main__":
    main()
