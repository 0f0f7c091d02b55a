"""Process plumbing shared by the dev servers: free ports, waiting for readiness, stopping our own PIDs."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

__all__ = [
    "DevServerError",
    "ServerNotFoundError",
    "ServerStartError",
    "free_port",
    "frozen",
    "process_tree",
    "sigstop",
    "wait_stopped",
]

LOOPBACK = "127.0.0.1"


class DevServerError(RuntimeError):
    """Base of the errors raised while running a development or test server."""


class ServerNotFoundError(DevServerError, FileNotFoundError):
    """The server's executable is not installed where we look for it."""


class ServerStartError(DevServerError):
    """A server did not become ready: it exited, timed out, or could not be prepared.

    The message carries the reason and the tail of the server's log.
    """


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (where outgoing connections get their local port)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere the fallback below applies when it does not fit


_SERVER_PORTS = range(10_000, min(_ephemeral_start(), 32768))
"""Where automatically chosen server ports come from: below the ephemeral range, so that no client's
outgoing connection can take a chosen port before its server binds it (seen: a Patroni node's PostgreSQL
port, chosen seconds before PostgreSQL started, taken meanwhile; the node never came up)."""
_choose = random.Random()  # its own generator: Hypothesis reseeds the global one in tests
_handed_out: set[int] = set()
"""Ports this process has chosen already: each goes to one server for its life (it restarts on it), and
a cluster chooses all its members' ports before any of them binds one (seen: a Patroni node's PostgreSQL
given the port of another node's REST API, chosen a moment later, and refused by the bind)."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago.

    Drawn at random below the kernel's ephemeral range, where only another server choosing the same way
    could take it first (bind to port 0 when that range is too small), and never one this process chose
    before. Servers started on an automatically chosen port still retry with a new one when the bind fails.

    Raises:
        OSError: no free port in 200 draws.

    Returns:
        The port number.
    """
    for _ in range(200):
        if len(_SERVER_PORTS) >= 1000:
            port = _choose.choice(_SERVER_PORTS)
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((LOOPBACK, 0))
                port = sock.getsockname()[1]
        if port in _handed_out or not _bindable(port):
            continue
        _handed_out.add(port)
        return port
    raise OSError("no free TCP port found on 127.0.0.1 in 200 tries")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def port_is_free(port: int) -> bool:
    """Return whether ``127.0.0.1:port`` can be bound right now (with ``SO_REUSEADDR``, as servers do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def log_tail(path: Path, lines: int = 40, since: int = 0) -> str:
    """Return the last ``lines`` lines of a log file (from byte ``since`` on), or a note if unreadable."""
    try:
        with path.open("rb") as f:
            f.seek(since)
            data = f.read()
    except OSError as exc:
        return f"<log {path} unreadable: {exc}>"
    text = data.decode("utf-8", errors="replace").rstrip("\n")
    if not text:
        return f"<log {path} is empty>"
    return "\n".join(text.splitlines()[-lines:])


def read_since(path: Path, offset: int) -> str:
    """Return what was appended to ``path`` after byte ``offset`` (empty if the file is missing)."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def file_size(path: Path) -> int:
    """Return the size of ``path`` in bytes, 0 if it does not exist."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def wait_until(
    ready: Callable[[], bool],
    *,
    proc: subprocess.Popen[bytes],
    timeout: float,
    what: str,
    log: Path,
    log_offset: int = 0,
) -> None:
    """Poll ``ready()`` until it is true, the process exits, or ``timeout`` seconds pass.

    Args:
        ready: Cheap check, polled every few milliseconds.
        proc: The server process; its exit ends the wait early.
        timeout: Seconds to wait at most.
        what: Name of the server for error messages.
        log: The server's log file, whose tail goes into the error.
        log_offset: Where this run's part of the log starts.

    Raises:
        ServerStartError: The process exited or the timeout passed first. The process is left as it is;
            the caller decides whether to kill it.
    """
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        if ready():
            return
        code = proc.poll()
        if code is not None:
            raise ServerStartError(
                f"{what} exited with status {code} before it was ready. Log {log}:\n"
                f"{log_tail(log, since=log_offset)}"
            )
        if time.monotonic() >= deadline:
            raise ServerStartError(
                f"{what} was not ready after {timeout:g} s. Log {log}:\n{log_tail(log, since=log_offset)}"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def stop_process(
    proc: subprocess.Popen[bytes],
    signals: Iterable[tuple[signal.Signals, float]],
    kill: Callable[[subprocess.Popen[bytes]], object] | None = None,
) -> int:
    """Stop a child process: send each signal in turn and wait, then ``kill`` it if it is still alive.

    The signals only ever go to ``proc`` itself, through its :class:`~subprocess.Popen` handle, which
    refuses to signal a PID it has already reaped (so a recycled PID is never hit).

    Args:
        proc: A child process we started.
        signals: ``(signal, seconds to wait after it)`` pairs, tried in order.
        kill: Called with ``proc`` last (also when it has already exited); it must reap it.
            :func:`kill_process` when omitted.

    Returns:
        The process's exit status (negative signal number if a signal ended it).
    """
    for sig, wait in signals:
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.wait(wait)
    if kill is None:
        return kill_process(proc)
    kill(proc)
    return proc.wait()


def kill_process(proc: subprocess.Popen[bytes]) -> int:
    """SIGKILL a child process we started, reap it, and return its exit status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    return proc.wait()


# A process is identified by PID plus start time (field 22 of /proc/PID/stat): a PID alone can be recycled.
ProcessId = tuple[int, int]


def _stat_fields(pid: int, tid: str | None = None) -> list[str] | None:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        raw = Path(path).read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may contain spaces: split after the last ')'.
    return raw[raw.rindex(")") + 2 :].split()


def process_id(pid: int) -> ProcessId | None:
    """Return ``pid`` with its start time, or None when no such process runs (Linux ``/proc``)."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] == "Z":
        return None
    return (pid, int(fields[19]))


def command_line(pid: int) -> str:
    """Return the command line (its title, for PostgreSQL's processes) of ``pid``; empty if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""
    return raw.replace(b"\0", b" ").decode("utf-8", errors="replace").strip()


def children_of(pid: int) -> list[ProcessId]:
    """Return the direct children of ``pid`` (Linux ``/proc``; empty elsewhere)."""
    found: list[ProcessId] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        # After the name: state(0) ppid(1) ... starttime is overall field 22, i.e. index 19 here.
        if fields is not None and int(fields[1]) == pid:
            found.append((int(entry), int(fields[19])))
    return found


def is_alive(process: ProcessId) -> bool:
    """Return whether the process still runs (a zombie or a recycled PID counts as gone)."""
    pid, start = process
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z" and int(fields[19]) == start


def wait_gone(processes: Iterable[ProcessId], timeout: float) -> list[ProcessId]:
    """Wait until the processes are gone; return those still alive after ``timeout`` seconds."""
    remaining = [p for p in processes if is_alive(p)]
    deadline = time.monotonic() + timeout
    while remaining and time.monotonic() < deadline:
        time.sleep(0.01)
        remaining = [p for p in remaining if is_alive(p)]
    return remaining


def kill_processes(processes: Iterable[ProcessId]) -> None:
    """SIGKILL processes identified by PID and start time, skipping any that already went away."""
    for process in processes:
        try:
            # A pidfd pins the process: once its start time checks out, the signal cannot hit a recycled PID.
            pidfd = os.pidfd_open(process[0])
        except ProcessLookupError:
            continue
        except OSError:  # no pidfd support (old kernel): a check then a kill, with a tiny window
            if is_alive(process):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process[0], signal.SIGKILL)
            continue
        try:
            if is_alive(process):
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        finally:
            os.close(pidfd)


def _children_map() -> dict[int, list[int]]:
    """Every process's direct children, from one pass over /proc."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return children
    for entry in entries:
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def process_tree(pid: int) -> list[int]:
    """Return ``pid`` and every process descended from it (Linux ``/proc``), parents first."""
    children = _children_map()
    tree, todo = [], [pid]
    while todo:
        tree.append(node := todo.pop(0))
        todo += children.get(node, [])
    return tree


# Thread states that run no more code: stopped (by a signal, or traced), zombie, dead.
_STILL = frozenset("TtZX")


def wait_stopped(pids: Iterable[int], *, timeout: float = 5.0) -> None:
    """Return once every thread of every process in ``pids`` is stopped (after SIGSTOP); gone ones count.

    Raises:
        TimeoutError: A thread was still running after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    for pid in pids:
        while True:
            try:
                threads = os.listdir(f"/proc/{pid}/task")
            except (FileNotFoundError, ProcessLookupError):
                break  # gone
            states = [fields[0] for tid in threads if (fields := _stat_fields(pid, tid)) is not None]
            if all(state in _STILL for state in states):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"process {pid} still runs {timeout:.0f} s after SIGSTOP")
            time.sleep(0.001)


def sigstop(*pids: int) -> list[int]:
    """SIGSTOP each of ``pids`` and return once every thread of them has stopped; returns those signalled.

    ``kill(SIGSTOP)`` alone returns before the process stops: Linux wakes one thread to take the signal, and
    only when that thread gets a CPU does it stop the others. On a busy machine a JVM's request threads run
    on meanwhile (a "frozen" Kafka broker once answered a request sent right after the signal). Every
    freeze of the test kit goes through here, so that a fault starts only once it is in place.
    """
    stopped = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
    wait_stopped(stopped)
    return stopped


@contextlib.contextmanager
def frozen(*pids: int) -> Iterator[list[int]]:
    """Stop each of ``pids`` and all their descendants dead (SIGSTOP) inside the block; SIGCONT afterwards.

    What a hung host looks like to its clients: the kernel still accepts TCP connections (the listen
    backlog) and acknowledges data, but nothing ever answers. The processes are resumed even when the block
    raises. Yields the PIDs stopped.
    """
    # Roots first; then their descendants, from one read of /proc per round, until a round finds none new:
    # a stopped process forks no more, so what a round misses was forked by one not yet stopped.
    stopped: list[int] = []
    try:
        todo = list(pids)
        while todo:
            stopped += sigstop(*todo)
            tree = _children_map()
            seen = set(stopped)
            todo = [child for parent in stopped for child in tree.get(parent, ()) if child not in seen]
        yield stopped
    finally:
        for member in reversed(stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(member, signal.SIGCONT)
