"""helexa: an LLM inference engine on Triton kernels, a paged KV cache it owns, and block-exact admission.

`from helexa import LLM, SamplingParams` for offline generation; `python -m helexa.server` to serve.
Importing `helexa` (or a light subpackage such as `helexa.admission`) loads nothing heavy: the
names below resolve on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from helexa._version import __version__

_LAZY = {
    "LLM": "helexa.llm",
    "RequestOutput": "helexa.llm",
    "RequestTimings": "helexa.llm",
    "SamplingParams": "helexa.model.sampling",
}

if TYPE_CHECKING:
    from helexa.llm import LLM, RequestOutput, RequestTimings
    from helexa.model.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "RequestTimings", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'helexa' has no attribute {name!r}")
