"""How the primary replicates, as ``dispenser check`` reports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dispenser.adapters.postgres.pool import Pooled

__all__ = ["Replication", "read_replication"]

_REPLICATION = """
SELECT host(inet_server_addr()) AS host, inet_server_port() AS port,
       (SELECT system_identifier::text FROM pg_control_system()) AS system,
       pg_walfile_name(pg_current_wal_lsn()) AS walfile,
       current_setting('synchronous_standby_names') AS standby_names,
       current_setting('synchronous_commit') AS synchronous_commit,
       (SELECT count(*) FROM pg_stat_replication) AS standbys,
       (SELECT count(*) FROM pg_stat_replication WHERE sync_state IN ('sync', 'quorum')) AS sync_standbys
"""


@dataclass(frozen=True, slots=True)
class Replication:
    """How the primary a store reaches replicates (for ``dispenser check``)."""

    primary: str
    """``host:port`` of the primary as it sees itself."""
    system: str
    timeline: int
    standbys: int
    """Standbys streaming from it (``pg_stat_replication``)."""
    sync_standbys: int
    """Of those, how many it waits for (visible to a superuser or ``pg_monitor`` only; else 0)."""
    standby_names: str
    """``synchronous_standby_names``: empty means commits wait for no standby."""
    synchronous_commit: str

    @property
    def synchronous(self) -> bool:
        """Whether a commit waits for a standby to have it."""
        return bool(self.standby_names.strip()) and self.synchronous_commit not in ("off", "local")


async def read_replication(conn: Pooled) -> Replication:
    """Which primary ``conn`` reached and how it replicates."""
    row = await conn.fetchrow(_REPLICATION)
    assert row is not None
    return Replication(
        primary=f"{row['host'] or 'local socket'}:{row['port'] or ''}".rstrip(":"),
        system=row["system"],
        timeline=int(row["walfile"][:8], 16),
        standbys=row["standbys"],
        sync_standbys=row["sync_standbys"],
        standby_names=row["standby_names"],
        synchronous_commit=row["synchronous_commit"],
    )
