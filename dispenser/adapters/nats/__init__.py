"""NATS (nats-py): connections, the ID service and its micro protocol, the client's transport, rate events."""

__all__ = ["client_transport", "connection", "micro", "peers", "rates", "service"]
