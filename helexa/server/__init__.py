"""helexa.server."""

__all__: list[str] = []
