"""Two live workers on different layouts whose node bits compose the same IDs: the second refuses.

Leaf's 41 + 10 + 12 worker 32 and a 5 + 5 layout's datacenter 1, worker 0 put the same 10 bits in the same
place (Leaf #187's fix half rolled out): their (datacenter, worker) pairs differ, their IDs do not.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from dispenser.config import Config
from dispenser.core.errors import WorkerIdInUse
from dispenser.core.snowflake import LEAF_EPOCH_MS
from dispenser.health import check_all
from dispenser_lab.servers import NatsServer

from .segment_support import running_worker
from .snowflake_support import snowflake_config

pytestmark = [pytest.mark.nats]

_prefixes = itertools.count(1)


def static(
    nats: NatsServer,
    state: Path,
    prefix: str,
    worker_id: int,
    *,
    datacenter_bits: int = 0,
    worker_bits: int = 10,
    datacenter_id: int = 0,
    epoch_ms: int = LEAF_EPOCH_MS,
) -> Config:
    """A ``static``-mode worker (no registry: only the peer guard stands between two equal node fields)."""
    return snowflake_config(
        nats.url,
        state,
        name="layouts",
        prefix=prefix,
        worker_id=worker_id,
        peer_recheck_interval=60,
        datacenter_bits=datacenter_bits,
        worker_bits=worker_bits,
        datacenter_id=datacenter_id,
        epoch_ms=epoch_ms,
    )


async def test_leaf_worker_32_and_twitter_datacenter_1_worker_0_do_not_both_serve(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """The 5 + 5 worker, started second, hears the Leaf-layout worker claim its node bits and refuses."""
    prefix = f"layouts{next(_prefixes)}"
    leaf = static(nats_server, tmp_path / "leaf", prefix, 32)
    twitter = static(
        nats_server, tmp_path / "dc1", prefix, 0, datacenter_bits=5, worker_bits=5, datacenter_id=1
    )
    async with running_worker(leaf) as first, running_worker(twitter) as second:
        assert first.identity_guard.state == "serving"
        assert second.identity_guard.state == "refused"
        refusal = second.identity_guard.refusal
        assert isinstance(refusal, WorkerIdInUse)
        assert "node bits 12-21 = 32" in str(refusal)
        results = {r.name: r for r in await check_all(first.config)}
        assert not results["snowflake peers"].ok  # `dispenser check` names both claims
        assert "datacenter 0, worker 32 (node bits 12-21 = 32" in results["snowflake peers"].detail


async def test_another_epoch_on_the_same_node_bits_is_refused_too(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """Worker 5 on Leaf's epoch and worker 5 on a later one: the later repeats the earlier's IDs, later."""
    prefix = f"layouts{next(_prefixes)}"
    first_config = static(nats_server, tmp_path / "a", prefix, 5)
    later = static(nats_server, tmp_path / "b", prefix, 5, epoch_ms=LEAF_EPOCH_MS + 86_400_000)
    async with running_worker(first_config) as first, running_worker(later) as second:
        assert (first.identity_guard.state, second.identity_guard.state) == ("serving", "refused")


async def test_node_bits_that_differ_keep_both_serving(nats_server: NatsServer, tmp_path: Path) -> None:
    """Leaf's worker 33 and the 5 + 5 layout's datacenter 1, worker 0: a bit apart, both serve."""
    prefix = f"layouts{next(_prefixes)}"
    leaf = static(nats_server, tmp_path / "leaf", prefix, 33)
    twitter = static(
        nats_server, tmp_path / "dc1", prefix, 0, datacenter_bits=5, worker_bits=5, datacenter_id=1
    )
    async with running_worker(leaf) as first, running_worker(twitter) as second:
        states = [w.identity_guard.state for w in (first, second)]
        assert states == ["serving", "serving"]
