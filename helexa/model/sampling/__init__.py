"""helexa.model.sampling: `SamplingParams` and the `Sampler` — one vectorised sampling call per step."""

from helexa.model.sampling.sampler import MAX_LOGPROBS, SampleResult, Sampler, SamplingParams, make_generator

__all__ = ["MAX_LOGPROBS", "SampleResult", "Sampler", "SamplingParams", "make_generator"]
