"""``tfs::fill_bonus_tokens`` against its reference (CPU: Triton interpreter in a subprocess; GPU: native), the
stride contract (accept_index width, not num_draft_tokens), and opcheck."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tfs_kernels.fill_bonus_tokens import fill_bonus_tokens, fill_bonus_tokens_ref

ROOT = Path(__file__).resolve().parents[1]


def random_case(bs: int, stride: int, device: str = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50000, (bs * stride,), generator=gen).to(device)
    lens = torch.randint(1, stride + 1, (bs,), generator=gen, dtype=torch.int32).to(device)
    return tokens, lens


def test_reference_picks_the_last_accepted_token():
    tokens = torch.tensor([10, 11, -1, -1, 20, 21, 22, 23, 30, -1, -1, -1])
    assert fill_bonus_tokens_ref(tokens, torch.tensor([2, 4, 1]), 4).tolist() == [11, 23, 30]


def test_stride_is_the_accept_index_width_not_num_draft_tokens():
    # topk > 1: num_steps = 3 -> accept_index width 4, while num_draft_tokens = 8
    num_steps, num_draft_tokens, bs = 3, 8, 5
    tokens, lens = random_case(bs, num_steps + 1, seed=3)
    right = fill_bonus_tokens(tokens, lens, num_steps + 1)
    expected = [tokens[i * (num_steps + 1) + lens[i] - 1].item() for i in range(bs)]
    assert right.tolist() == expected
    # the reverted upstream bug: the same buffer read with num_draft_tokens as the stride
    padded = torch.cat([tokens, torch.zeros(bs * (num_draft_tokens - num_steps - 1), dtype=torch.int64)])
    wrong = fill_bonus_tokens(padded, lens, num_draft_tokens)
    assert wrong[0] == right[0] and wrong.tolist() != expected


_INTERPRETED = """
import torch
from tfs_kernels.fill_bonus_tokens import fill_bonus_tokens, fill_bonus_tokens_ref
for seed, (bs, stride) in enumerate([(1, 1), (3, 4), (130, 5), (257, 9)]):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50000, (bs * stride,), generator=gen)
    for dtype in (torch.int32, torch.int64):
        lens = torch.randint(1, stride + 1, (bs,), generator=gen).to(dtype)
        out = torch.ops.tfs.fill_bonus_tokens(tokens, lens, stride)
        assert out.dtype == torch.int64 and torch.equal(out, fill_bonus_tokens_ref(tokens, lens, stride)), seed
print("interpreted ok")
"""


def test_triton_kernel_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and "interpreted ok" in proc.stdout, proc.stderr[-2000:]


def test_opcheck_cpu():
    tokens, lens = random_case(6, 4)
    torch.library.opcheck(torch.ops.tfs.fill_bonus_tokens.default, (tokens, lens, 4),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.parametrize("bs,stride", [(1, 1), (7, 4), (4096, 9)])
def test_triton_kernel_on_gpu(bs, stride):
    tokens, lens = random_case(bs, stride, device="cuda", seed=bs)
    out = fill_bonus_tokens(tokens, lens, stride)
    torch.testing.assert_close(out, fill_bonus_tokens_ref(tokens, lens, stride), rtol=0, atol=0)
    torch.library.opcheck(torch.ops.tfs.fill_bonus_tokens.default, (tokens, lens, stride))
    compiled = torch.compile(lambda t, n: fill_bonus_tokens(t, n, stride) + 0, fullgraph=True)
    torch.testing.assert_close(compiled(tokens, lens), fill_bonus_tokens_ref(tokens, lens, stride))
