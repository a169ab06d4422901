"""Verify-step cost on a CUDA GPU: one TARGET_VERIFY forward over a chain of k draft tokens (k + 1 tokens per
request with the root) against one DECODE forward of a plain engine, both compiled (CUDA graphs), plus the whole
verify path (forward, on-device verification, the host read of accept lengths).

    python bench/bench_gpu_verify.py --model smollm2_135m_random --batch 1 8 --context 512 [overrides...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

sys.path.insert(0, os.path.dirname(__file__))

from bench_gpu_decode import decode_setup  # noqa: E402
from framework import LLM  # noqa: E402
from framework.batch import ForwardBatch, ForwardMode  # noqa: E402
from framework.request import Request  # noqa: E402
from framework.sampling import SamplingParams  # noqa: E402
from framework.speculative.tree import ancestor_mask, chain_tree  # noqa: E402
from framework.speculative.verify import verify  # noqa: E402


def cuda_ms(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2_135m_random")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("extra", nargs="*")
    args = ap.parse_args()
    rows = []
    for bs in args.batch:
        # the decode step of a plain engine (a speculative engine captures verify graphs, not plain decode ones)
        plain, _, plain_batch = decode_setup(args.model, "reduce_overhead", bs, args.context, 8,
                                             [f"compile.batch_sizes=[{bs}]", *args.extra])
        with torch.inference_mode():
            t_decode = cuda_ms(lambda: plain.runner.forward(plain_batch), args.reps)
        for r in list(plain.scheduler.running):
            plain.abort(r.rid)
        del plain, plain_batch
        # one engine per batch size: the verify graphs for each k compile during the warm-up replays
        llm = LLM([f"model={args.model}", "model.device=cuda", "compile=reduce_overhead", "speculative=ngram",
                   f"speculative.num_steps={max(args.ks)}", f"scheduler.max_running_requests={bs}",
                   f"compile.batch_sizes=[{bs}]", f"scheduler.max_context={args.context + 64}", *args.extra])
        eng = llm.engine
        gen = torch.Generator().manual_seed(0)
        vocab = min(eng.model.args.vocab_size, 49152)
        reqs = [Request(rid=i, prompt_ids=torch.randint(0, vocab, (args.context,), generator=gen).tolist(),
                        params=SamplingParams(max_tokens=8, ignore_eos=True), seed=0, max_new_tokens=8)
                for i in range(bs)]
        for r in reqs:
            eng.submit(r)
        eng.step()  # prefill
        step = eng.scheduler.schedule()
        decode = eng.scheduler.build_batch(step)
        L = [r.kv_len for r in reqs]
        n_max = max(args.ks) + 1
        slots = eng.allocator.assign([r.row for r in reqs], L, [x + n_max for x in L]).view(bs, n_max)
        dev = slots.device
        kv = torch.tensor(L, device=dev)
        with torch.inference_mode():
            for k in args.ks:
                n = k + 1
                tokens = torch.randint(0, vocab, (bs, n), generator=gen).to(dev)
                tree = chain_tree(tokens, torch.ones_like(tokens, dtype=torch.bool))
                batch = ForwardBatch(
                    mode=ForwardMode.TARGET_VERIFY, input_ids=tokens.reshape(-1),
                    positions=(kv[:, None] + tree.depths).reshape(-1), out_cache_loc=slots[:, :n].reshape(-1),
                    req_pool_indices=decode.req_pool_indices, seq_lens=kv + n, seq_lens_cpu=[x + n for x in L],
                    extend_lens_cpu=[n] * bs, logits_index=torch.arange(bs * n, device=dev),
                    custom_mask=ancestor_mask(tree.parents), sampling=decode.sampling)
                t_verify = cuda_ms(lambda: eng.runner.forward(batch), args.reps)

                def full_path():
                    logits, _ = eng.runner.forward(batch)
                    return verify(tree, logits, decode.sampling, k, 1).accept_lens.tolist()

                t_path = cuda_ms(full_path, args.reps)
                rows.append((bs, k, t_decode, t_verify, t_path))
                print(f"bs={bs} k={k}: decode {t_decode:.3f} ms, verify fwd {t_verify:.3f} ms, "
                      f"path {t_path:.3f} ms", flush=True)
        for r in reqs:
            eng.abort(r.rid)
        del llm, eng
    print(f"\n{args.model}, bf16, context {args.context}, {torch.cuda.get_device_name()}, compiled")
    print(f"{'batch':>5} {'k':>3} {'decode ms':>10} {'verify ms':>10} {'ratio':>6} {'verify path ms':>15} {'ratio':>6}")
    for bs, k, d, v, p in rows:
        print(f"{bs:>5} {k:>3} {d:>10.3f} {v:>10.3f} {v / d:>6.2f} {p:>15.3f} {p / d:>6.2f}")


if __name__ == "__main__":
    main()
