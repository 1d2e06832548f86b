"""Sampling defaults from a model's `generation_config.json`, applied as vLLM applies them.

A model's `generation_config.json` may recommend how to sample it. Like vLLM, helexa reads these keys
(Hugging Face name → `SamplingParams` field) and uses them for the fields a request leaves out:

    temperature → temperature     top_p → top_p     top_k → top_k     min_p → min_p
    repetition_penalty → repetition_penalty         max_new_tokens → max_tokens

Every other key is ignored, `do_sample` included: as in vLLM, `do_sample: false` does not make
requests greedy (a file that wants greedy sampling says `temperature: 0`). A key whose value is
null counts as absent. Precedence: the request's own value, then the file's, then `SamplingParams`'s
defaults.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helexa.model.sampling.params import SamplingParams

__all__ = ["GENERATION_CONFIG", "HF_KEYS", "SamplingDefaults", "read_sampling_defaults", "resolve_sampling_defaults"]

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
# Hugging Face generation_config key -> SamplingParams field, in the order they are logged.
HF_KEYS: dict[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# What each field's value must be, in the words of a ValueError (`SamplingParams` does the checking).
_EXPECTED = {
    "temperature": "a finite number >= 0",
    "top_p": "a number in (0, 1]",
    "top_k": "an integer in [-1, 2147483647] (-1 or 0: disabled)",
    "min_p": "a number in [0, 1]",
    "repetition_penalty": "a finite number > 0",
    "max_tokens": "an integer >= 1",
}


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling defaults a model's generation config sets; a field is None where it sets nothing.

    `source` is the file they were read from (None: no file was read, e.g. `--generation-config none`).
    As `read_sampling_defaults` builds them, every value that is not None is valid for its `SamplingParams` field.
    """

    source: Path | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def values(self) -> dict[str, Any]:
        """The fields the file sets, by `SamplingParams` name (max_tokens included), in `HF_KEYS` order."""
        return {name: value for name in HF_KEYS.values() if (value := getattr(self, name)) is not None}

    def sampling(self) -> dict[str, Any]:
        """As `values()` without `max_tokens`: what a request's omitted sampling fields default to."""
        return {name: value for name, value in self.values().items() if name != "max_tokens"}

    def params(self, **overrides: Any) -> SamplingParams:
        """`SamplingParams` of these defaults, `overrides` winning (max_tokens: the file's, else 16)."""
        return SamplingParams(**{**self.values(), **overrides})

    def describe(self) -> str:
        """One log line: `sampling defaults from <file>: temperature=0.2 top_p=0.9` (`: none` when it sets
        none of the keys), or `sampling defaults: none (...)` when no file was read."""
        if self.source is None:
            return "sampling defaults: none (no generation config read; helexa's own defaults apply)"
        shown = " ".join(f"{name}={value}" for name, value in self.values().items()) or "none"
        return f"sampling defaults from {self.source}: {shown}"


def read_sampling_defaults(folder: str | Path) -> SamplingDefaults:
    """The sampling defaults `folder`'s generation_config.json sets (see the module docstring).

    Without the file: empty defaults (`source=None`). A file that is not a JSON object raises
    ValueError naming the file; so does a value of a used key that its `SamplingParams` field would
    refuse (wrong type or out of range), naming the file and the key.
    """
    path = Path(folder) / GENERATION_CONFIG
    if not path.is_file():
        return SamplingDefaults()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    values = {
        field: _checked(path, key, field, data[key]) for key, field in HF_KEYS.items() if data.get(key) is not None
    }
    if data.get("do_sample") is False:
        log.info(f"{path} sets do_sample=false; helexa, like vLLM, ignores do_sample (temperature decides)")
    return SamplingDefaults(source=path, **values)


def resolve_sampling_defaults(setting: str, model_dir: str | Path) -> SamplingDefaults:
    """The defaults `--generation-config setting` stands for.

    `auto`: `model_dir`'s generation_config.json (none when the model has no such file); `none`:
    no defaults (helexa's own `SamplingParams` defaults apply); anything else: a folder that must
    hold a generation_config.json (ValueError otherwise, naming the flag and the path).
    """
    if setting == "none":
        return SamplingDefaults()
    if setting == "auto":
        return read_sampling_defaults(model_dir)
    folder = Path(setting).expanduser()
    if not folder.is_dir():
        raise ValueError(
            f"--generation-config {setting}: not a folder (give auto, none, or a folder with {GENERATION_CONFIG})"
        )
    if not (folder / GENERATION_CONFIG).is_file():
        raise ValueError(f"--generation-config {setting}: the folder has no {GENERATION_CONFIG}")
    return read_sampling_defaults(folder)


def _checked(path: Path, key: str, field: str, value: Any) -> Any:
    """`value` if `SamplingParams` accepts it for `field`; else a ValueError naming the file and `key`."""
    try:
        SamplingParams(**{field: value})
    except ValueError:
        raise ValueError(f"{path}: {key} must be {_EXPECTED[field]}, got {value!r}") from None
    return value
