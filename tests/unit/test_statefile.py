"""The local snowflake state file: atomic round trips, clear errors, and where it lives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispenser.adapters.local.statefile import LocalState, LocalStateFile, default_state_dir, state_file_path
from dispenser.core.errors import StateFileCorrupt

STATE = LocalState(worker_id=7, high_water_ms=1_700_000_000_000, mode="zookeeper", registry_name="orders")


def test_missing_file_loads_as_none(tmp_path: Path) -> None:
    """No file yet: load returns None (a first start), not an error."""
    assert LocalStateFile(tmp_path / "state.json").load() is None


def test_round_trip(tmp_path: Path) -> None:
    """What was saved is what loads, in a directory created on the way."""
    store = LocalStateFile(tmp_path / "a" / "b" / "state.json")
    store.save(STATE)
    assert store.load() == STATE


async def test_async_save_round_trip(tmp_path: Path) -> None:
    """The async save writes the same file, from a worker thread."""
    store = LocalStateFile(tmp_path / "state.json")
    await store.asave(STATE)
    assert store.load() == STATE


def test_save_replaces_atomically_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    """A second save replaces the file (a new inode, by rename) and leaves nothing else behind."""
    path = tmp_path / "state.json"
    store = LocalStateFile(path)
    store.save(STATE)
    first_inode = path.stat().st_ino
    newer = LocalState(worker_id=7, high_water_ms=1_700_000_009_000, mode="zookeeper", registry_name="orders")
    store.save(newer)
    assert store.load() == newer
    assert path.stat().st_ino != first_inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_failed_save_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If the rename fails, the old state stays readable and the temporary file is removed."""
    path = tmp_path / "state.json"
    store = LocalStateFile(path)
    store.save(STATE)

    def broken_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space left"):
        store.save(LocalState(worker_id=7, high_water_ms=1, mode="zookeeper", registry_name="orders"))
    monkeypatch.undo()
    assert store.load() == STATE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


@pytest.mark.parametrize(
    ("content", "detail"),
    [
        (b"{not json", "malformed"),
        (b"", "truncated|malformed|Input data was truncated"),
        (
            b'{"format": 1, "state": {"worker_id": -1, "high_water_ms": 0, "mode": "static", '
            b'"registry_name": "x"}}',
            r"worker_id",
        ),
        (
            b'{"format": 1, "state": {"worker_id": 1, "high_water_ms": 0, "mode": "etcd", '
            b'"registry_name": "x"}}',
            r"mode",
        ),
        (b'{"format": 2, "state": {}}', r"format"),
        (
            b'{"format": 1, "state": {"worker_id": 1, "mode": "static", "registry_name": "x"}}',
            "high_water_ms",
        ),
    ],
)
def test_corrupt_file_is_a_clear_error(tmp_path: Path, content: bytes, detail: str) -> None:
    """A file that is not a valid state raises StateFileCorrupt naming the file and the problem."""
    path = tmp_path / "state.json"
    path.write_bytes(content)
    with pytest.raises(StateFileCorrupt, match=detail) as caught:
        LocalStateFile(path).load()
    assert str(path) in caught.value.message


def test_default_directory_is_not_temporary(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The default directory follows XDG_STATE_HOME, else ~/.local/state, never a temp directory."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert default_state_dir() == tmp_path / "xdg" / "leaf-dispenser"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert default_state_dir() == Path.home() / ".local" / "state" / "leaf-dispenser"


def test_each_worker_has_its_own_file(tmp_path: Path) -> None:
    """Two workers sharing a state directory get different, filesystem-safe file names."""
    a = state_file_path(tmp_path, "orders", "10.0.0.1:8080")
    b = state_file_path(tmp_path, "orders", "10.0.0.1:8081")
    assert a != b
    assert a.parent == tmp_path
    assert a.name == "snowflake-orders-10.0.0.1_8080.json"
    assert "/" not in state_file_path(tmp_path, "a/b", "../x:1").name


def test_matches_checks_mode_and_registry() -> None:
    """A state from another mode or registry namespace does not count as this worker's record."""
    assert STATE.matches("zookeeper", "orders")
    assert not STATE.matches("static", "orders")
    assert not STATE.matches("zookeeper", "payments")
