"""helexa.server: the OpenAI-compatible HTTP API over the engine (`python -m helexa.server`).

Module map:
- `app`        `create_app(engine, settings)`: the Starlette app and its routes.
- `protocol`   request bodies → validated `GenerationRequest`s (400 naming the `param`).
- `generation` `GenerationRun`: a request's engine submissions, merged token streams, aborts.
- `formats`    one formatter per API: response bodies and streamed events (chat, completions, responses).
- `sse`        server-sent-event framing and a response that notices a client leaving.
- `errors`     `APIError`: OpenAI-shaped errors; every status and code, admission's rejections included.
- `middleware` request ids and the last-resort 500, Bearer auth, the request-body limit (413).
- `metrics`    `ServerMetrics`: Prometheus metrics on a per-app registry.
- `settings`   `ServerSettings`: bind address, API key, body limit, shutdown grace.
- `cli`        the flags → `EngineConfig` + `ServerSettings`.
- `serve`      `HelexaServer`: uvicorn with the start-up line and a graceful drain on SIGTERM/SIGINT.
"""

from helexa.server.app import create_app
from helexa.server.errors import APIError
from helexa.server.metrics import METRIC_NAMES, ServerMetrics
from helexa.server.protocol import GenerationRequest
from helexa.server.serve import HelexaServer
from helexa.server.settings import ServerSettings

__all__ = [
    "METRIC_NAMES",
    "APIError",
    "GenerationRequest",
    "HelexaServer",
    "ServerMetrics",
    "ServerSettings",
    "create_app",
]
