"""`python -m helexa.server`: load the engine, serve the OpenAI-compatible API, drain on SIGTERM/SIGINT.

The engine runs in this process, or with `HELEXA_ENGINE_PROCESS=1` in its own (`helexa.engine.core`).
"""

from __future__ import annotations

import logging
import sys

from helexa.engine.core import CoreDied, start_engine
from helexa.heap import freeze_heap
from helexa.model.weights.pull import DownloadError
from helexa.server.app import create_app
from helexa.server.cli import build_parser, configs_from_args
from helexa.server.serve import HelexaServer

logger = logging.getLogger("helexa.server")


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]), load the model, serve until a signal; return the exit status.

    0 after a graceful shutdown; 2 for bad flags (argparse); 1 when the model cannot be loaded or the
    address cannot be bound.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        engine_config, settings = configs_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    try:
        engine = start_engine(engine_config)
    except (ValueError, OSError, DownloadError, CoreDied) as exc:
        logger.error("cannot load the model: %s", exc)
        return 1
    server = HelexaServer(create_app(engine, settings), engine, settings)
    freeze_heap("server")  # no collector pause of the loaded heap on the event loop (or, in-process, in a step)
    try:
        server.run()
    finally:
        engine.shutdown(0.0)
    if not server.started:
        logger.error("the server did not start (is %s:%d free?)", settings.host, settings.port)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
