"""Which database a worker's tags live in: PostgreSQL's system identifier and the database's name."""

from __future__ import annotations

from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.core.residue_claims import Database

__all__ = ["database_of"]

_IDENTITY = """
SELECT (SELECT system_identifier::text FROM pg_control_system()) AS system, current_database() AS name
"""


async def database_of(store: PostgresSegmentStore) -> Database:
    """The database ``store`` reaches (the primary's system identifier is its replicas' too).

    Raises:
        StoreUnavailable: PostgreSQL could not be reached.
    """
    row = await store.fetchrow("reading the database's identity", _IDENTITY)
    assert row is not None  # a SELECT without FROM returns one row
    return Database(row["system"], row["name"])
