"""Adapters: the only modules that import drivers, and where their exceptions become ours.

One package per technology; they never import each other (``pyproject.toml``'s import contracts).
"""

__all__ = ["http", "kafka", "local", "mysql", "nats", "postgres", "prometheus", "zookeeper"]
