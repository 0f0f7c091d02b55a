"""Async orchestration of the pure core against the ports; no driver is imported here."""
