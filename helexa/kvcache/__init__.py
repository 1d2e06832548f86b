"""helexa.kvcache."""

__all__: list[str] = []
