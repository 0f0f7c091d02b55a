"""Meituan's Leaf itself, run beside the dispenser: its HTTP answers captured for the drop-in tests."""

__all__: list[str] = []
