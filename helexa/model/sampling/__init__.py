"""helexa.model.sampling: `SamplingParams` (params.py) and the vectorised `Sampler` (sampler.py)."""

from helexa.model.sampling.params import MAX_LOGPROBS, SamplingParams
from helexa.model.sampling.sampler import Sampler, SampleResult, make_generator

__all__ = ["MAX_LOGPROBS", "SampleResult", "Sampler", "SamplingParams", "make_generator"]
