"""helexa: an LLM inference engine on Triton kernels, a paged KV cache it owns, and block-exact admission.

`from helexa import LLM, SamplingParams` for offline generation; `python -m helexa.server` to serve.
"""

__version__ = "0.1.0"  # before the imports: helexa.model.weights.pull records it

from helexa.llm import LLM, RequestOutput, RequestTimings  # noqa: E402
from helexa.model.sampling import SamplingParams  # noqa: E402

__all__ = ["LLM", "RequestOutput", "RequestTimings", "SamplingParams", "__version__"]
