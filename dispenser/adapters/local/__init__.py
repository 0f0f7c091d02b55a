"""What a worker keeps on its own disk: the snowflake state file and the configured (static) worker ID."""

__all__ = ["grants", "statefile", "static_registry"]
