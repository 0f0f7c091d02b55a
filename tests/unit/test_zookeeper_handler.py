"""The kazoo handler's silence limit, on a loopback socket: what counts as a silent server and what does not."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from dispenser.adapters.zookeeper.handler import BoundedHandler

SILENCE = 0.2


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A listening loopback socket standing for a server."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server


@pytest.fixture
def link(listener: socket.socket) -> Iterator[tuple[BoundedHandler, socket.socket, socket.socket]]:
    """A handler connected (through its own ``create_connection``) to ``listener``: (handler, ours, theirs)."""
    handler = BoundedHandler(io_timeout=1.0, silence_limit=SILENCE)
    ours = handler.create_connection(address=listener.getsockname(), timeout=1.0)
    theirs, _ = listener.accept()
    with ours, theirs:
        yield handler, ours, theirs


def test_a_server_that_answers_nothing_is_dropped_after_the_silence_limit(
    link: tuple[BoundedHandler, socket.socket, socket.socket],
) -> None:
    handler, ours, _theirs = link
    handler.select([], [ours], [], 1.0)  # kazoo writes a request (or a ping)
    began = time.monotonic()
    with pytest.raises(TimeoutError, match="sent nothing"):  # noqa: PT012
        while time.monotonic() - began < 2:
            assert handler.select([ours], [], [], 0.05)[0] == []
    assert SILENCE * 0.9 < time.monotonic() - began < SILENCE + 0.5


def test_an_answer_resets_the_silence(link: tuple[BoundedHandler, socket.socket, socket.socket]) -> None:
    handler, ours, theirs = link
    for _ in range(4):  # 4 x 0.15 s: longer than the limit in all, never silent that long
        handler.select([], [ours], [], 1.0)
        time.sleep(0.15)
        theirs.sendall(b"x")
        assert handler.select([ours], [], [], 0.5)[0] == [ours]
        assert ours.recv(1) == b"x"


def test_a_thread_that_woke_late_is_not_taken_for_a_silent_server(
    link: tuple[BoundedHandler, socket.socket, socket.socket],
) -> None:
    """Nothing written since the server last spoke: however long ago, kazoo gets to send its ping first."""
    handler, ours, theirs = link
    time.sleep(SILENCE * 2)  # the connection thread starved: its ping is late, not unanswered
    assert handler.select([ours], [], [], 0.01)[0] == []
    handler.select([], [ours], [], 1.0)  # the ping goes out
    theirs.sendall(b"x")  # and is answered at once
    assert handler.select([ours], [], [], 0.5)[0] == [ours]


def test_the_next_attempt_after_a_silent_server_goes_elsewhere(
    link: tuple[BoundedHandler, socket.socket, socket.socket], listener: socket.socket
) -> None:
    """Dropped for its silence, the same server is refused once at once; another, or the same later, is not."""
    handler, ours, _theirs = link
    handler.select([], [ours], [], 1.0)
    began = time.monotonic()
    with pytest.raises(TimeoutError):  # noqa: PT012
        while time.monotonic() - began < 2:  # a handler that never drops fails here, not at pytest's timeout
            handler.select([ours], [], [], 0.05)
    silent = listener.getsockname()
    with pytest.raises(ConnectionRefusedError, match="silent a moment ago"):
        handler.create_connection(address=silent, timeout=1.0)
    with socket.create_server(("127.0.0.1", 0)) as other:
        handler.create_connection(address=other.getsockname(), timeout=1.0).close()
    handler.create_connection(address=silent, timeout=1.0).close()  # once: then tried like any other
