"""PostgreSQL (asyncpg): the segment store, its schema, the fleet's request answers and worker IDs.

Its face (the modules used from outside); ``hosts``, ``pool``, ``primary``, ``heartbeat``, ``tags``, ``peaks``
and ``replication`` are the segment store's parts.
"""

__all__ = ["errors", "replay", "schema", "segments", "workers"]
