"""The remembered segment grants: durable before a segment is used, per database, shared through the directory."""

from __future__ import annotations

import asyncio
import logging
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

import dispenser.adapters.local.grants as module
from dispenser.adapters.local.grants import GrantFile
from dispenser.adapters.local.statefile import write_atomically
from dispenser.adapters.postgres.primary import PrimaryWatch
from dispenser.app import open_grants
from dispenser.config import load_config
from dispenser.core.errors import StateDirUnusable, StoreUnavailable
from dispenser.health import check_grants_dir


async def test_a_grant_is_on_disk_when_remember_returns(tmp_path: Path) -> None:
    grants = GrantFile.open(tmp_path)
    await grants.remember("ids", "order", 1001)
    await grants.remember("ids", "order", 901)  # lower: the highest stays
    await grants.set_server("ids", "7000/3")
    grants.close()
    again = GrantFile.open(tmp_path)  # the same slot, so the same file: a restart remembers
    try:
        assert again.path == grants.path
        assert await again.remembered("ids") == {"order": 1001}
        assert again.server("ids") == "7000/3"
        assert await again.remembered("other") == {}
        assert again.server("other") is None
    finally:
        again.close()


async def test_concurrent_grants_all_reach_the_file(tmp_path: Path) -> None:
    grants = GrantFile.open(tmp_path)
    await asyncio.gather(*(grants.remember("ids", f"t{i}", i * 100) for i in range(1, 50)))
    grants.close()
    again = GrantFile.open(tmp_path)
    try:
        assert await again.remembered("ids") == {f"t{i}": i * 100 for i in range(1, 50)}
    finally:
        again.close()


async def test_workers_sharing_a_directory_see_each_others_grants(tmp_path: Path) -> None:
    first = GrantFile.open(tmp_path)
    second = GrantFile.open(tmp_path)  # a second live worker takes another slot, another file
    try:
        assert first.path != second.path
        await first.remember("ids", "order", 500)
        await second.remember("ids", "order", 700)
        await second.remember("ids", "user", 50)
        # The highest of every worker's, even of one that is down (its file stays).
        second.close()
        assert await first.remembered("ids") == {"order": 700, "user": 50}
    finally:
        first.close()


async def test_a_failed_write_is_logged_once_and_the_grant_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(path: Path, payload: bytes) -> None:
        raise OSError(28, "No space left on device")

    grants = GrantFile.open(tmp_path)
    monkeypatch.setattr(module, "write_atomically", refuse)
    try:
        with caplog.at_level(logging.ERROR):
            await grants.remember("ids", "order", 10)
            await grants.remember("ids", "order", 20)
        assert await grants.remembered("ids") == {"order": 20}
        assert caplog.text.count("cannot save the segment grants") == 1
    finally:
        grants.close()


async def test_a_foreign_file_is_ignored_with_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "segment-grants-someone.json").write_text("not json")
    grants = GrantFile.open(tmp_path)
    try:
        assert await grants.remembered("ids") == {}
        assert "not a segment grants file" in caplog.text
    finally:
        grants.close()


async def test_an_unusable_state_directory_refuses_the_start_and_fails_check(tmp_path: Path) -> None:
    """Not a silent fall-back to memory (a restart would then repair nothing): `serve` refuses, `check` fails."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    config = load_config(environ={"DISPENSER_SEGMENT_STATE_DIR": str(not_a_dir / "state")})
    with pytest.raises(StateDirUnusable, match=r"cannot keep the segment grants in .*/file/state") as refused:
        await open_grants(config)
    assert "segment.remember_grants = false" in str(refused.value)
    result = await check_grants_dir(config)
    assert not result.ok
    assert "`serve` would refuse to start" in result.detail
    off = load_config(environ={"DISPENSER_SEGMENT_REMEMBER_GRANTS": "false"})
    assert await open_grants(off) is None
    usable = load_config(environ={"DISPENSER_SEGMENT_STATE_DIR": str(tmp_path / "state")})
    result = await check_grants_dir(usable)
    assert result.ok, result.detail


async def test_grants_are_kept_per_cluster_whatever_the_timeline(tmp_path: Path) -> None:
    """Keys are ``<system>/<database>``; a cluster's grants count on every timeline (issue 29 item 1).

    Before, only grants made on the asked timeline or an earlier one counted: a PITR restored onto an
    earlier timeline was repaired from nothing.
    """
    grants = GrantFile.open(tmp_path)
    try:
        await grants.set_server("7000/ids", "7000/3")
        await grants.remember("7000/ids", "order", 1001)
        await grants.set_server("8000/ids", "8000/1")  # another cluster with a database of the same name
        await grants.remember("8000/ids", "order", 51)
        assert await grants.remembered("7000/ids") == {"order": 1001}
        assert await grants.remembered("8000/ids") == {"order": 51}
        assert await grants.remembered("9000/ids") == {}
        assert grants.floor("7000/ids", "order") == 1001
        assert grants.floor("8000/ids", "order") == 51
        assert grants.floor("9000/ids", "order") is None
        assert grants.floor("7000/ids", "user") is None
    finally:
        grants.close()


async def test_a_file_of_the_first_format_is_placed_in_its_cluster(tmp_path: Path) -> None:
    """Format 1 kept grants by database name: each entry goes under the system of the primary it last used."""
    grants = GrantFile.open(tmp_path)
    assert grants.path is not None
    grants.close()
    grants.path.write_text(
        '{"format": 1, "databases": {"ids": {"server": "7000/3", "max_ids": {"order": 1001}},'
        ' "never": {"max_ids": {"x": 5}}}}'
    )
    again = GrantFile.open(tmp_path)
    try:
        assert await again.remembered("7000/ids") == {"order": 1001}
        assert again.server("7000/ids") == "7000/3"
        assert await again.remembered("ids") == {}
        assert await again.remembered("never") == {}  # no primary recorded: no cluster to put it in
        await again.remember("7000/ids", "order", 2001)
    finally:
        again.close()
    assert '"format":2' in grants.path.read_text()


async def test_a_write_that_never_ends_fails_the_grant_within_its_bound_then_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29 item 10: a stalled disk fails the grant (unavailable, retryable) instead of holding it for ever.

    Before, every remember() waited on the one writer, stuck in the default executor: every tag's fetch
    hung, and the process outlived its stop budget (the executor is joined without a timeout at exit).
    """
    disk = threading.Event()  # the disk answers once set
    real = write_atomically

    def stalled_disk(path: Path, payload: bytes) -> None:
        disk.wait()
        real(path, payload)

    grants = GrantFile.open(tmp_path)
    grants.write_timeout = 0.2
    monkeypatch.setattr(module, "write_atomically", stalled_disk)
    try:
        with pytest.raises(StoreUnavailable, match="could not be saved") as failed:
            await asyncio.wait_for(grants.remember("ids", "order", 10), 10)  # a bound on the test only
        assert (failed.value.code, failed.value.retryable) == ("unavailable", True)
        assert grants.floor("ids", "order") == 10  # kept in memory: this worker never goes below it
        stalled = grants.stalled()
        assert stalled is not None
        assert "no segment is fetched until it does" in stalled
        # The threads holding the disk are daemons: they cannot keep the process alive at exit.
        assert all(t.daemon for t in threading.enumerate() if t.name == "segment-grants-io")
        disk.set()
        for _ in range(1000):  # the stuck write ends; wait for the state, not a time
            if grants.stalled() is None:
                break
            await asyncio.sleep(0.01)
        assert grants.stalled() is None
        await grants.remember("ids", "order", 20)
        assert caplog.text.count("could not be saved") == 1  # once per stall
        assert "segment grants saved to" in caplog.text
    finally:
        disk.set()
        grants.close()
    again = GrantFile.open(tmp_path)
    try:
        assert await again.remembered("ids") == {"order": 20}
    finally:
        again.close()


async def test_a_state_directory_that_stalls_at_start_refuses_the_start_within_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29 item 10: the first read of the directory is bounded too, and the event loop runs meanwhile.

    Before, the worker opened its grant file on the event loop itself: a stalled disk at start blocked the
    loop, so not even SIGTERM was heard.
    """
    disk = threading.Event()
    real = module._load

    def stalled_read(path: Path) -> object:
        disk.wait(10)  # a bound on the test only: the disk "stalls" for 10 s
        return real(path)

    monkeypatch.setattr(module, "_load", stalled_read)
    monkeypatch.setattr(module, "WRITE_TIMEOUT", 0.2)
    config = load_config(environ={"DISPENSER_SEGMENT_STATE_DIR": str(tmp_path / "state")})
    ticks = 0

    async def loop_runs() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticking = asyncio.create_task(loop_runs())
    try:
        with pytest.raises(StateDirUnusable, match=r"no answer within 0.2 s \(a stalled disk\?\)"):
            await open_grants(config)
        assert ticks > 1  # the loop went on while the disk stalled
    finally:
        ticking.cancel()
        disk.set()


async def test_a_stalled_write_is_answered_without_the_state_directory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33 item 8: the ``unavailable`` a stalled disk causes does not say where the state directory is.

    Both errors a segment request can be answered with (the grant that timed out, and the fetches refused
    until the write ends) named the grant file's path; it stays in ``str(error)`` and the log.
    """
    disk = threading.Event()
    real = write_atomically

    def stalled_disk(path: Path, payload: bytes) -> None:
        disk.wait()
        real(path, payload)

    hidden = tmp_path / "hidden-state-dir"
    grants = GrantFile.open(hidden)
    grants.write_timeout = 0.2
    monkeypatch.setattr(module, "write_atomically", stalled_disk)
    try:
        with pytest.raises(StoreUnavailable) as timed_out:
            await asyncio.wait_for(grants.remember("ids", "order", 10), 10)  # a bound on the test only
        with pytest.raises(StoreUnavailable) as refused:
            PrimaryWatch("postgresql://db", grants).check_memory()
        for error in (timed_out.value, refused.value):
            assert "could not be saved" in error.message
            assert "hidden-state-dir" not in error.message
            assert str(hidden) in str(error)  # the operator's words (the log, the CLI) still say where
        assert str(hidden) in caplog.text
    finally:
        disk.set()
        grants.close()


async def test_check_fails_on_a_stalled_state_directory_within_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29 item 10: `dispenser check` on a stalled state directory fails in the bound, never hangs.

    Before, its probe ran in the default executor with no bound: the check (and the command's exit, which
    joins that executor) waited as long as the disk did.
    """
    disk = threading.Event()
    real = tempfile.NamedTemporaryFile

    def stalled_create(*args: Any, **kwargs: Any) -> Any:
        disk.wait(10)  # a bound on the test only: the disk "stalls" for 10 s
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", stalled_create)
    monkeypatch.setattr(module, "WRITE_TIMEOUT", 0.2)
    config = load_config(environ={"DISPENSER_SEGMENT_STATE_DIR": str(tmp_path / "state")})
    try:
        result = await check_grants_dir(config)
    finally:
        disk.set()
    assert not result.ok
    assert "no answer within 0.2 s (a stalled disk?)" in result.detail
