"""`python -m helexa pull [NAME]`: fetch and convert a known model into the cache, print its directory."""

from __future__ import annotations

import argparse
import sys

from helexa.model.weights.pull import DEFAULT_MODEL, KNOWN_MODELS, DownloadError, pull


def _pull(args: argparse.Namespace) -> int:
    try:
        path = pull(args.name, home=args.home, progress=not args.quiet)
    except (ValueError, DownloadError) as exc:
        print(f"helexa pull: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `python -m helexa` argument parser, one subparser per subcommand."""
    parser = argparse.ArgumentParser(prog="python -m helexa", description="helexa command-line tools")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "pull",
        help="fetch and convert a known model into the cache",
        description=f"Fetch and convert a known model. Known: {', '.join(sorted(KNOWN_MODELS))}.",
    )
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL, help=f"model name (default: {DEFAULT_MODEL})")
    p.add_argument("--home", default=None, help="cache root (default: $HELEXA_HOME or ~/.cache/helexa)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_pull)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `python -m helexa` with `argv` (default: sys.argv[1:]); return the exit status."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
