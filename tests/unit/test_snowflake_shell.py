"""The snowflake shell against an in-memory registry: what it does while its worker ID changes hands."""

from __future__ import annotations

import asyncio

import pytest

from dispenser.core.errors import LeaseLost
from dispenser.core.snowflake import SnowflakeLayout
from dispenser.ports import SystemClock, WorkerLease
from dispenser.service.snowflake import SnowflakeGenerator, SnowflakeSettings

LAYOUT = SnowflakeLayout()


class SwitchingRegistry:
    """Loses its lease on demand; registering again claims worker ID 1, and vouches for it at once."""

    def __init__(self) -> None:
        self.held = True
        self.claimed = asyncio.Event()
        self.release = asyncio.Event()

    async def register(self) -> WorkerLease:
        self.held = True  # the claim is in: from here on can_issue() is true, for ID 1
        self.claimed.set()
        await self.release.wait()  # e.g. reading the ID's high-water node
        return WorkerLease(1, 0)

    async def report(self, high_water_ms: int) -> None:
        return None

    def can_issue(self) -> bool:
        return self.held

    async def close(self) -> None:
        return None


async def no_persist(_worker_id: int, _high_water_ms: int) -> None:
    return None


async def test_nothing_is_issued_under_the_old_id_while_a_new_one_is_being_registered() -> None:
    """After a lost lease, no ID comes out until the new worker ID replaced the old one in the generator."""
    registry = SwitchingRegistry()
    generator = SnowflakeGenerator(
        LAYOUT,
        WorkerLease(0, 0),
        registry,
        SystemClock(),
        no_persist,
        settings=SnowflakeSettings(report_interval=3600.0),
    )
    await generator.start()
    first = generator.try_take("t", 1)
    assert first is not None
    assert LAYOUT.decompose(first.ranges[0][0]).worker_id == 0
    registry.held = False
    with pytest.raises(LeaseLost):
        generator.try_take("t", 1)
    await registry.claimed.wait()
    assert registry.can_issue()  # the registry vouches for ID 1, but the generator still holds ID 0
    with pytest.raises(LeaseLost):
        generator.try_take("t", 1)
    with pytest.raises(LeaseLost):
        await generator.take("t", 1, asyncio.get_running_loop().time() + 1)
    registry.release.set()
    for _ in range(100):
        if generator.worker_id == 1:
            break
        await asyncio.sleep(0.01)
    batch = generator.try_take("t", 1) or await generator.take("t", 1, asyncio.get_running_loop().time() + 1)
    assert LAYOUT.decompose(batch.ranges[0][0]).worker_id == 1
    await generator.stop()
