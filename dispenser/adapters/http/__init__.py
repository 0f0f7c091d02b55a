"""HTTP (aiohttp): Leaf's HTTP API, and the operations endpoints ``/metrics``, ``/healthz`` and ``/readyz``."""

from dispenser.adapters.http.server import HttpServer, LeafApi, Operations

__all__ = ["HttpServer", "LeafApi", "Operations"]
