"""HTTP (aiohttp): Leaf's HTTP API, and the operations endpoints ``/metrics``, ``/healthz``, ``/readyz``, ``/status``."""

from dispenser.adapters.http.server import HttpServer, LeafApi, Operations
from dispenser.adapters.http.status import StatusSource

__all__ = ["HttpServer", "LeafApi", "Operations", "StatusSource"]
