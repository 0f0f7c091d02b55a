"""The pure core: state in, decision out. Nothing here imports asyncio or a driver, or reads a clock.

Its face is its modules (``from dispenser.core.refill import Refill``); each names its own ``__all__``.
"""

__all__ = [
    "errors",
    "ids",
    "leaf_import",
    "lru",
    "peers",
    "permute",
    "rate",
    "refill",
    "segment",
    "snowflake",
    "step",
    "store_rules",
    "tags",
]
