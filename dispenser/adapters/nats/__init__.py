"""NATS (nats-py): connections, the ID service and its micro protocol, one-off requests, rate events."""

__all__ = ["client", "connection", "micro", "peers", "rates", "service"]
