"""helexa.model.sampling: `SamplingParams` (params.py) and the vectorised `Sampler` (sampler.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from helexa.lazy import lazy_attributes
from helexa.model.sampling.params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from helexa.model.sampling.sampler import Sampler, SampleResult, make_generator

# The sampler (torch) is imported when first read: the parameters are all the server's side of a core needs.
_HOME = {name: "helexa.model.sampling.sampler" for name in ("Sampler", "SampleResult", "make_generator")}
__getattr__ = lazy_attributes(__name__, _HOME)

__all__ = ["MAX_LOGPROBS", "SampleResult", "Sampler", "SamplingParams", "make_generator"]
