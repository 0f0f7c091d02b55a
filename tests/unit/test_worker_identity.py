"""The stable worker identity kept in the state directory, and how a clean stop's record is honoured."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dispenser.adapters.local.statefile import LocalState, WorkerIdentity
from dispenser.ports import WorkerLease
from dispenser.registries import _merge_cached


def test_the_identity_survives_a_release_and_is_not_shared(tmp_path: Path) -> None:
    """The same slot gives the same address after a release; a second live claimant gets another one."""
    first = WorkerIdentity.claim(tmp_path, "orders")
    second = WorkerIdentity.claim(tmp_path, "orders")
    assert first.address != second.address
    addresses = (first.address, second.address)
    first.release()
    second.release()
    again = [WorkerIdentity.claim(tmp_path, "orders") for _ in range(2)]
    assert tuple(identity.address for identity in again) == addresses
    host, _, token = addresses[0].rpartition(":")
    assert host
    assert len(token) == 8
    for identity in again:
        identity.release()


def test_namespaces_have_their_own_identities(tmp_path: Path) -> None:
    """Two registry names never compete for a slot."""
    a = WorkerIdentity.claim(tmp_path, "orders")
    b = WorkerIdentity.claim(tmp_path, "payments")
    assert a.path.name == "identity-orders-0"
    assert b.path.name == "identity-payments-0"
    a.release()
    b.release()


def test_a_killed_holder_frees_its_slot(tmp_path: Path) -> None:
    """Kill -9 of the holder: the kernel drops its lock, so the restart gets the same address back."""
    code = (
        "import sys, time; from pathlib import Path; from dispenser.adapters.local.statefile import WorkerIdentity;"
        "i = WorkerIdentity.claim(Path(sys.argv[1]), 'orders'); print(i.address, flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        held = child.stdout.readline().strip()
        other = WorkerIdentity.claim(tmp_path, "orders")
        assert other.address != held  # slot 0 is locked by the child
        other.release()
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    deadline = time.monotonic() + 5
    while True:
        identity = WorkerIdentity.claim(tmp_path, "orders")
        if identity.address == held or time.monotonic() > deadline:
            break
        identity.release()
    assert identity.address == held
    identity.release()


def test_a_torn_identity_file_gets_a_fresh_identity(tmp_path: Path) -> None:
    """A slot file without a valid address (a crash during the first write) is rewritten, not trusted."""
    (tmp_path / "identity-orders-0").write_text("garbage-without-colon")
    identity = WorkerIdentity.claim(tmp_path, "orders")
    assert ":" in identity.address
    assert (tmp_path / "identity-orders-0").read_text().strip() == identity.address
    identity.release()


def state(high_water: int, reserved: int | None, worker_id: int = 3) -> LocalState:
    return LocalState(
        worker_id=worker_id,
        high_water_ms=high_water,
        mode="zookeeper",
        registry_name="orders",
        clean_stop_reserved_ms=reserved,
    )


def test_a_clean_stop_replaces_the_reservation_with_the_exact_mark() -> None:
    """Registry at the reservation (or below it): the clean stop's exact last millisecond is honoured."""
    assert _merge_cached(WorkerLease(3, 6_000), state(1_000, 6_000)).high_water_ms == 1_000
    assert _merge_cached(WorkerLease(3, 500), state(1_000, 6_000)).high_water_ms == 1_000


def test_a_registry_mark_past_the_clean_reservation_wins() -> None:
    """Someone wrote after our clean stop (another holder of the ID): their mark stands."""
    assert _merge_cached(WorkerLease(3, 9_000), state(1_000, 6_000)).high_water_ms == 9_000


def test_without_a_clean_stop_the_higher_mark_wins() -> None:
    """A crash leaves no clean record: the higher of the registry's and the cache's marks stands."""
    assert _merge_cached(WorkerLease(3, 6_000), state(1_000, None)).high_water_ms == 6_000
    assert _merge_cached(WorkerLease(3, 6_000), state(7_000, None)).high_water_ms == 7_000


def test_another_worker_ids_record_is_ignored() -> None:
    """The cache of another worker ID says nothing about this one."""
    assert _merge_cached(WorkerLease(4, 6_000), state(1_000, 6_000)).high_water_ms == 6_000
