"""The pure core: state in, decision out. Nothing here imports asyncio or a driver, or reads a clock."""
