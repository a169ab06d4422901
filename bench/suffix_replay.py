"""Suffix decoding's acceptance without forwards: plain greedy outputs of the real SmolLM2-135M (computed once,
eager, on this CPU; ``--outputs FILE`` keeps them), replayed through the suffix drafter at batch 1 (requests one
after another, each finished one joining the global tree; the prompts served twice: first sight, then repeated),
beside n-gram chains and the bound of any drafter that drafts paths of the same two suffix trees.

    .venv/bin/python bench/suffix_replay.py --prompts bench/prompts/shared.jsonl
    .venv/bin/python bench/suffix_replay.py --knobs "" "max_spec_factor=4" "max_spec_factor=8 min_token_prob=0"
    .venv/bin/python bench/suffix_replay.py --prompts bench/prompts/shared32.jsonl --merge 1 2 4
    .venv/bin/python bench/suffix_replay.py --max-tokens 256 --outputs .suffix_replay_256.json --ngram-steps 4 1 2 3 5 6 7 8

Printed per drafter and pass: tokens per iteration, counted as the engine's ``mean_accept_len`` counts them (an
iteration without a draft is a plain step of one token). ``bound`` follows, at every step, the true continuation
down the node of every matched suffix of both trees as far as the trees have it (unlimited width, ``num_steps``
deep): no choice of draft trees from those counts accepts more. The replay matches ``bench_drafters_cpu.py``'s
acceptance at batch 1 to about 1% (its warm-up request also joins the global tree).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from typing import Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from framework.request import Request  # noqa: E402
from framework.speculative.ngram import NgramIndex  # noqa: E402
from framework.speculative.suffix import SuffixDrafter, resolve_auto_shape  # noqa: E402
from framework.speculative.suffix_tree import SuffixTree, grow_draft  # noqa: E402

PROMPTS = os.path.join(os.path.dirname(__file__), "prompts", "grounded.jsonl")
SUFFIX = dict(num_steps=7, topk=4, num_draft_tokens=8, suffix_max_depth=24, suffix_cache_tokens=16384,
              max_spec_factor=2.0, max_spec_offset=0.0, min_token_prob=0.1)  # conf/speculative/suffix.yaml (CPU)


def plain_outputs(prompts: str, max_tokens: int, path: str) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy output ids) per prompt, from ``path`` when it holds them for these arguments."""
    key = {"prompts": os.path.abspath(prompts), "max_tokens": max_tokens}
    if path and os.path.exists(path):
        saved = json.load(open(path))
        if saved["key"] == key:
            return [tuple(pair) for pair in saved["pairs"]]
    from framework import LLM
    from framework.request_parsing import parse_request
    llm = LLM(["model=smollm2_135m", "compile=eager"])
    items = [dict(json.loads(line), max_tokens=max_tokens) for line in open(prompts) if line.strip()]
    outs = llm.generate(items)
    pairs = [(parse_request(it, 0, llm.tokenizer, 1 << 30, 1 << 30, llm.engine.config.sampling).prompt_ids,
              o.token_ids) for it, o in zip(items, outs)]
    llm.close()
    if path:
        json.dump({"key": key, "pairs": pairs}, open(path, "w"))
    return pairs


def walk(tree: SuffixTree, node: int, truth: list[int], most: int) -> int:
    """How many tokens of ``truth`` the tree has below its node ``node`` (at most ``most``)."""
    depth = 0
    while depth < min(most, len(truth)) and tree.kids[node] and truth[depth] in tree.kids[node]:
        node = tree.kids[node][truth[depth]]
        depth += 1
    return depth


def replay(pairs, passes: int, accept: Callable[[Request, list[int]], int], finish: Callable[[], None]) -> list[float]:
    """Tokens per iteration of each pass; ``accept(req, truth)`` -> draft tokens accepted at this step."""
    result = []
    for _ in range(passes):
        steps = emitted = 0
        for prompt, out in pairs:
            req = Request(rid=0, prompt_ids=list(prompt), params=None, seed=0, max_new_tokens=len(out))
            req.output_ids = list(out[:1])  # the prefill's token
            while len(req.output_ids) < len(out):
                truth = out[len(req.output_ids):]
                n = min(accept(req, truth), len(truth) - 1) + 1
                steps, emitted = steps + 1, emitted + n
                req.output_ids += truth[:n]
            req.finish_reason = "length"
        finish()
        result.append(emitted / max(steps, 1))
    return result


def suffix_run(pairs, knobs: dict, passes: int, bound: bool = False) -> list[float]:
    drafter = SuffixDrafter(types.SimpleNamespace(device="cpu"), types.SimpleNamespace(**knobs))

    def accept(req: Request, truth: list[int]) -> int:
        drafter._retire_finished()
        if bound:  # the longest walk of the truth below any matched suffix of either tree
            tail = drafter._state(req).sync(req)
            return max([walk(tree, node, truth, knobs["num_steps"]) for tree in (req.drafter_state.tree,
                        drafter.global_tree) for node, _ in tree.matches(tail)], default=0)
        on_path, best = {0}, 0  # draft nodes on the true path
        for i, (token, parent, depth) in enumerate(drafter.batch_drafts([req])[0][0], start=1):
            if parent in on_path and depth <= len(truth) and truth[depth - 1] == token:
                on_path.add(i)
                best = max(best, depth)
        return best

    return replay(pairs, passes, accept, drafter._retire_finished)


def merged_run(pairs, knobs: dict, merge: int, passes: int) -> list[float]:
    """Like :func:`suffix_run`, but the drafts of the ``merge`` best-scoring matches (of both trees, each grown from
    its own counts, as a chain's candidates are) merged into one tree of at most ``num_draft_tokens - 1`` nodes, best
    draft first: the union of single-match drafts, beside the drafter's trees (every match's counts mixed)."""
    drafter = SuffixDrafter(types.SimpleNamespace(device="cpu"), types.SimpleNamespace(**knobs))
    most = knobs["num_draft_tokens"] - 1

    def accept(req: Request, truth: list[int]) -> int:
        drafter._retire_finished()
        tail = drafter._state(req).sync(req)
        drafts = []
        for tree in (req.drafter_state.tree, drafter.global_tree):
            for node, length in tree.matches(tail):
                budget = min(most, int(knobs["max_spec_factor"] * length + knobs["max_spec_offset"]))
                if budget >= 1:
                    drafts.append(grow_draft([(tree, node, 1.0)], budget, knobs["num_steps"], knobs["topk"],
                                              knobs["min_token_prob"]))
        paths: set[tuple[int, ...]] = set()  # the merged tree's nodes, as their token paths from the root
        for nodes, _ in sorted(drafts, key=lambda d: -sum(d[1]))[:merge]:
            own: list[tuple[int, ...]] = []
            for token, parent, _ in nodes:
                own.append((own[parent - 1] if parent else ()) + (token,))
                if own[-1] not in paths and len(paths) >= most:
                    break
                paths.add(own[-1])
        n = 0
        while n < len(truth) and tuple(truth[:n + 1]) in paths:
            n += 1
        return n

    return replay(pairs, passes, accept, drafter._retire_finished)


def ngram_run(pairs, passes: int, num_steps: int = 5, min_n: int = 1, max_n: int = 6) -> list[float]:
    def accept(req: Request, truth: list[int]) -> int:
        index = NgramIndex(min_n, max_n)
        index.sync(req.prompt_ids + req.output_ids)
        conts = index.continuations(num_steps, 1)
        draft = conts[0] if conts else []
        n = 0
        while n < len(draft) and n < len(truth) and draft[n] == truth[n]:
            n += 1
        return n
    return replay(pairs, passes, accept, lambda: None)


def parse_knobs(text: str) -> dict:
    """``name=value ...`` over the CPU's defaults; ``topk=0`` / ``num_draft_tokens=0`` (auto) resolved as the CPU's
    config resolves them (conf/speculative/suffix.yaml)."""
    knobs = dict(SUFFIX)
    for item in text.split():
        name, _, value = item.partition("=")
        if name not in SUFFIX:
            raise SystemExit(f"--knobs: unknown knob {name!r}; known: {', '.join(SUFFIX)}")
        knobs[name] = type(SUFFIX[name])(value)
    shape = types.SimpleNamespace(version="auto", **knobs)
    resolve_auto_shape(shape, "cpu")
    knobs["topk"] = shape.topk
    knobs["num_draft_tokens"] = shape.num_draft_tokens or knobs["num_steps"] + 1  # (0 left: a chain's)
    return knobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", default=PROMPTS)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--outputs", default=".suffix_replay.json", help="cache of the plain outputs ('' : none)")
    ap.add_argument("--knobs", nargs="+", default=[""],
                    help="suffix knob sets, each 'name=value ...' over the conf's defaults ('': the defaults)")
    ap.add_argument("--ngram-steps", type=int, nargs="+", default=[5],
                    help="n-gram chains at these depths too (the suffix ratios are against the first)")
    ap.add_argument("--merge", type=int, nargs="*", default=[],
                    help="also each knob set with the drafts of this many best matches merged into one tree")
    args = ap.parse_args()
    pairs = plain_outputs(args.prompts, args.max_tokens, args.outputs)
    print(f"{len(pairs)} requests, {sum(len(o) for _, o in pairs)} tokens, {args.prompts}; tokens per iteration, "
          f"first / repeat pass")
    chains = {steps: ngram_run(pairs, 2, num_steps=steps) for steps in args.ngram_steps}
    for steps, got in chains.items():
        print(f"{f'ngram (chains, num_steps {steps})':>44}  {got[0]:.3f} / {got[1]:.3f}")
    ngram = chains[args.ngram_steps[0]]
    for text in args.knobs:
        knobs = parse_knobs(text)
        got = suffix_run(pairs, knobs, 2)
        bound = suffix_run(pairs, knobs, 2, bound=True)
        print(f"{'suffix ' + (text or '(defaults)'):>44}  {got[0]:.3f} / {got[1]:.3f}  ({got[0] / ngram[0]:.2f}x "
              f"ngram; bound {bound[0]:.3f} / {bound[1]:.3f}: {bound[0] / ngram[0]:.2f}x)")
        for merge in args.merge:
            got = merged_run(pairs, knobs, merge, 2)
            print(f"{f'  the {merge} best matches merged':>44}  {got[0]:.3f} / {got[1]:.3f}  ({got[0] / ngram[0]:.2f}x "
                  f"ngram)")


if __name__ == "__main__":
    main()
