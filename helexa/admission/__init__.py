"""helexa.admission."""

__all__: list[str] = []
