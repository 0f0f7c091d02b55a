"""Each tag's fleet rate peak, saved so that a restarted fleet sizes its first segments from it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import asyncpg

from dispenser.core.ids import Kind

if TYPE_CHECKING:
    from dispenser.adapters.postgres.pool import Pooled

__all__ = ["load_peaks", "save_peaks"]

_SAVE_PEAKS = """
INSERT INTO dispenser_rate_peak (biz_tag, kind, peak, peak_at, update_time)
SELECT t, $2, p, to_timestamp(a), now() FROM unnest($1::text[], $3::float8[], $4::float8[]) AS x(t, p, a)
ON CONFLICT (biz_tag, kind) DO UPDATE SET peak = EXCLUDED.peak, peak_at = EXCLUDED.peak_at, update_time = now()
"""
_LOAD_PEAKS = (
    "SELECT biz_tag, peak, extract(epoch FROM peak_at)::float8 AS at FROM dispenser_rate_peak WHERE kind = $1"
)


async def save_peaks(conn: Pooled, kind: Kind, peaks: dict[str, tuple[float, float]]) -> None:
    """Save each tag's ``(peak IDs/s, unix seconds seen)`` in one round trip (the last writer wins)."""
    tags = list(peaks)
    await conn.execute(_SAVE_PEAKS, tags, kind, [peaks[t][0] for t in tags], [peaks[t][1] for t in tags])


async def load_peaks(conn: Pooled, kind: Kind) -> dict[str, tuple[float, float]]:
    """The saved ``tag → (peak IDs/s, unix seconds seen)`` (empty before schema version 2)."""
    try:
        rows = await conn.fetch(_LOAD_PEAKS, kind)
    except asyncpg.UndefinedTableError:  # not migrated yet: no peaks, not an outage
        return {}
    return {row["biz_tag"]: (row["peak"], row["at"]) for row in rows}
