"""Per-request sampling parameters and the on-device sampler."""

from framework.sampling.params import RequestError, SamplingParams
from framework.sampling.sampler import probs_from_logits, sample, sample_from_probs, uniform_noise

__all__ = ["RequestError", "SamplingParams", "probs_from_logits", "sample", "sample_from_probs", "uniform_noise"]
