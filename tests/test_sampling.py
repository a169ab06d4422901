"""The on-device sampler: greedy, seeded reproducibility, the sampled distribution, top-k / top-p, validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from framework.batch import SamplingBatch
from framework.config import SamplingConfig
from framework.sampling import RequestError, SamplingParams, probs_from_logits, sample, sample_from_probs, uniform_noise


def batch_of(n: int, temperature: float, top_k: int = 0, top_p: float = 1.0, seeds=None, steps=None):
    seeds = torch.arange(n) if seeds is None else seeds
    steps = torch.zeros(n, dtype=torch.int64) if steps is None else steps
    return SamplingBatch(temperatures=torch.full((n,), temperature), top_ps=torch.full((n,), top_p),
                         top_ks=torch.full((n,), top_k), seeds=seeds, steps=steps, all_greedy=temperature == 0,
                         need_top_k_top_p=top_k > 0 or top_p < 1)


def naive_filter(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    p = torch.softmax(logits.double() / temperature, -1).numpy()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    mass = 0.0
    for rank, i in enumerate(order):
        if (top_k and rank >= top_k) or mass >= top_p:
            break
        keep[i] = True
        mass += p[i]
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def test_greedy_is_argmax():
    logits = torch.randn(5, 100)
    assert torch.equal(sample(logits, batch_of(5, 0.0)), logits.argmax(-1))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 4, 1.0), (1.0, 0, 0.8),
                                                     (0.9, 5, 0.7)])
def test_sampled_distribution_matches(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(12) * 1.5
    n = 20000
    rows = logits.expand(n, -1)
    tokens = sample(rows, batch_of(n, temperature, top_k, top_p, seeds=torch.full((n,), 7),
                                   steps=torch.arange(n)))
    expected = naive_filter(logits, temperature, top_k, top_p)
    counts = np.bincount(tokens.numpy(), minlength=12)
    assert counts[expected == 0].sum() == 0, "a filtered-out token was sampled"
    support = expected > 0
    _, p_value = chisquare(counts[support], expected[support] * n)
    assert p_value >= 0.01, (counts, expected * n)
    # the same test rejects a sampler at the wrong temperature: it has the power to fail
    wrong = sample(rows, batch_of(n, temperature * 1.5, top_k, top_p, seeds=torch.full((n,), 7),
                                  steps=torch.arange(n)))
    wrong_counts = np.bincount(wrong.numpy(), minlength=12)
    outside = wrong_counts[~support].sum() > 0
    assert outside or chisquare(wrong_counts[support], expected[support] * n)[1] < 0.01


def test_filter_matches_naive():
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    temps, ks, ps = torch.tensor([1.0, 0.5, 2.0, 1.0]), torch.tensor([0, 3, 10, 0]), torch.tensor([0.9, 1.0, 0.5, 1.0])
    probs = probs_from_logits(logits, temps, ks, ps, need_top_k_top_p=True)
    for i in range(4):
        ref = naive_filter(logits[i], temps[i].item(), ks[i].item(), ps[i].item())
        np.testing.assert_allclose(probs[i].double().numpy(), ref, rtol=1e-5, atol=1e-7)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    torch.manual_seed(2)
    logits = torch.randn(3, 1000)
    alone = sample(logits[1:2], batch_of(1, 1.0, seeds=torch.tensor([42]), steps=torch.tensor([5])))
    together = sample(logits, batch_of(3, 1.0, seeds=torch.tensor([1, 42, 3]), steps=torch.tensor([0, 5, 9])))
    assert together[1] == alone[0]
    other_step = sample_from_probs(torch.softmax(logits, -1), torch.tensor([1, 42, 3]), torch.tensor([0, 6, 9]))
    assert other_step.shape == (3,)


def test_noise_never_reaches_one():
    """Seed 335, step 0, column 30005 once drew u = 1.0 (24 bits rounded up): -log(u) = 0, and the race picked
    column 30005 from any distribution, a one-hot one included (about once per 340 rows of a 49k vocabulary)."""
    seeds = torch.tensor([335, 1, 2, 3], dtype=torch.int64)
    u = uniform_noise(seeds, torch.zeros(4, dtype=torch.int64), 49152)
    assert float(u.max()) < 1.0 and float(u.min()) > 0.0
    one_hot = torch.zeros(4, 49152)
    one_hot[:, 7] = 1.0
    assert sample_from_probs(one_hot, seeds, torch.zeros(4, dtype=torch.int64)).tolist() == [7] * 4


def test_mixed_greedy_and_sampled_rows():
    logits = torch.randn(2, 200)
    b = batch_of(2, 1.0)
    b.temperatures = torch.tensor([0.0, 1.0])
    b.all_greedy = False
    assert sample(logits, b)[0] == logits[0].argmax()


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("max_tokens", 0),
                                         ("max_tokens", -3), ("top_k", -2), ("temperature", "hot"),
                                         ("max_tokens", 2.5), ("stop", [""]), ("seed", "x")])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams.from_request(SamplingConfig(), {field: value})


def test_request_overrides_defaults():
    p = SamplingParams.from_request(SamplingConfig(max_tokens=9, temperature=0.5), {"top_k": 5, "stop": "END"})
    assert (p.max_tokens, p.temperature, p.top_k, p.stop) == (9, 0.5, 5, ["END"])
