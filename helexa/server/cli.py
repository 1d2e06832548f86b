"""`python -m helexa.server`'s flags: built from the fields of `EngineConfig` and `ServerSettings`."""

from __future__ import annotations

import argparse
import os

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


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerSettings]:
    """The engine config and server settings the parsed flags describe (raises ValueError for bad combinations)."""
    if args.api_key is None:
        args = argparse.Namespace(**{**vars(args), "api_key": os.environ.get("HELEXA_API_KEY") or None})
    return from_flags(EngineConfig, args), from_flags(ServerSettings, args)
