"""`python -m helexa.server`'s flags: built from the fields of `EngineConfig` and `ServerSettings`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from helexa.config import EngineConfig, HelpFormatter, add_flags, from_flags
from helexa.server.settings import ServerSettings


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `python -m helexa.server`; every flag is optional."""
    parser = argparse.ArgumentParser(
        prog="python -m helexa.server",
        description="Serve a model over an OpenAI-compatible HTTP API with block-exact KV admission.",
        formatter_class=HelpFormatter,
    )
    groups: dict = {}
    add_flags(parser, EngineConfig, groups)
    add_flags(parser, ServerSettings, groups)
    return parser


def read_api_key(path: str) -> str:
    """The key in `path`: its first line, stripped; ValueError when the file cannot be read or it is empty."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key-file {path}: cannot read it: {exc}") from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise ValueError(f"--api-key-file {path}: the file is empty")
    return key


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerSettings]:
    """The engine config and server settings the parsed flags describe (raises ValueError for bad combinations).

    The API key comes from `--api-key`, else `--api-key-file` (its first line), else `$HELEXA_API_KEY`.
    """
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        args = argparse.Namespace(**{**vars(args), "api_key": read_api_key(args.api_key_file)})
    if args.api_key is None:
        args = argparse.Namespace(**{**vars(args), "api_key": os.environ.get("HELEXA_API_KEY") or None})
    return from_flags(EngineConfig, args), from_flags(ServerSettings, args)
