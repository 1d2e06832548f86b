"""The package's version: one assignment, read by `helexa/__init__.py`, the weights' provenance records
(`helexa.model.weights.pull`) and, statically, by setuptools (`[tool.setuptools.dynamic]` in pyproject.toml)."""

__version__ = "0.1.0"
