"""helexa.kernels."""

__all__: list[str] = []
