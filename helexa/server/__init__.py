"""helexa.server: the OpenAI-compatible HTTP API over the engine (`python -m helexa.server`)."""

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
