"""Async orchestration of the pure core against the ports; no driver is imported here.

Its face is its modules; each names its own ``__all__``.
"""

__all__ = [
    "answering",
    "decode",
    "dedup",
    "dispatch",
    "enrichment",
    "identity",
    "permuted",
    "rates",
    "retry",
    "segments",
    "snowflake",
    "timing",
]
