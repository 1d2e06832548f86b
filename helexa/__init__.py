"""helexa: an LLM inference engine on Triton kernels, a paged KV cache it owns, and block-exact admission."""

__version__ = "0.1.0"
__all__ = ["__version__"]
