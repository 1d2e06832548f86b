"""helexa.engine."""

__all__: list[str] = []
