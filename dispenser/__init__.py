"""Leaf dispenser: unique 64-bit IDs over message brokers, from Postgres segments or snowflake generators."""

__version__ = "0.1.0"

__all__ = ["__version__"]
