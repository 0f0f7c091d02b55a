"""What :mod:`dispenser.adapters.zookeeper.session` assumes about kazoo, one assumption per test.

Each fails loudly when a kazoo upgrade breaks what it names, before a ZooKeeper test could fail in some
roundabout way. The behaviours behind these names (credentials re-sent on every connection before queued
requests, the session kept across a restart, expiry noticed and replaced, NoAuth mapped) are tested
against a real server in ``tests/integration/test_zookeeper_registry.py`` and ``test_zookeeper_acl.py``.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import tomllib
from pathlib import Path
from typing import Any

import kazoo.client  # type: ignore[import-untyped]  # kazoo has no type hints
import kazoo.exceptions  # type: ignore[import-untyped]
import kazoo.handlers.threading  # type: ignore[import-untyped]
import kazoo.interfaces  # type: ignore[import-untyped]
import kazoo.protocol.connection  # type: ignore[import-untyped]
import kazoo.protocol.serialization  # type: ignore[import-untyped]
import kazoo.retry  # type: ignore[import-untyped]
import kazoo.security  # type: ignore[import-untyped]
import pytest
from packaging.requirements import Requirement

from dispenser.adapters.zookeeper import session as zk_session
from dispenser.adapters.zookeeper.acl import digest_id, registry_acl, shared_acl

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _parameters(call: Any) -> set[str]:
    return set(inspect.signature(call).parameters)


def test_installed_kazoo_is_within_the_pinned_range() -> None:
    """The installed kazoo satisfies pyproject's pin, and the pin has an upper bound (raise it on purpose)."""
    # A worker's driver: the [server] extra (the base install is the client).
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]["server"]
    (pin,) = [Requirement(d) for d in dependencies if Requirement(d).name == "kazoo"]
    assert any(spec.operator in {"<", "<=", "=="} for spec in pin.specifier), f"{pin} has no upper bound"
    assert pin.specifier.contains(importlib.metadata.version("kazoo")), pin


def test_client_takes_the_options_the_session_passes() -> None:
    """KazooClient still takes the keyword arguments ZkSession.open passes."""
    expected = {
        "hosts",
        "timeout",
        "connection_retry",
        "command_retry",
        "auth_data",
        "default_acl",
        "read_only",
        "logger",
        "handler",
    }
    assert expected <= _parameters(kazoo.client.KazooClient)


@pytest.mark.parametrize(
    ("method", "arguments"),
    [
        ("create_async", {"path", "value", "acl", "ephemeral", "sequence"}),
        ("get_async", {"path"}),
        ("set_async", {"path", "value", "version"}),
        ("delete_async", {"path", "version"}),
        ("get_children_async", {"path"}),
        ("get_acls_async", {"path"}),
        ("set_acls_async", {"path", "acls"}),
        ("add_listener", {"listener"}),
        ("start_async", set()),
        ("stop", set()),
        ("close", set()),
    ],
)
def test_client_methods_used(method: str, arguments: set[str]) -> None:
    """The public KazooClient methods the session calls exist with the arguments it passes."""
    call = getattr(kazoo.client.KazooClient, method)
    assert arguments <= _parameters(call)


def test_client_properties_used() -> None:
    """client_id (session ID and password) and connected are public properties."""
    for name in ("client_id", "connected"):
        assert isinstance(inspect.getattr_static(kazoo.client.KazooClient, name), property), name


def test_session_states_the_listener_tells_apart() -> None:
    """The listener sees CONNECTED, SUSPENDED and LOST, three different states."""
    states = {
        kazoo.client.KazooState.CONNECTED,
        kazoo.client.KazooState.SUSPENDED,
        kazoo.client.KazooState.LOST,
    }
    assert len(states) == 3


def test_reconnect_retry_takes_the_back_off_options() -> None:
    """KazooRetry takes the back-off settings (the cap is what brings a worker back within a second)."""
    retry = kazoo.retry.KazooRetry(max_tries=-1, delay=0.05, backoff=2, max_jitter=0.2, max_delay=1.0)
    assert retry.max_delay == 1.0


def test_handler_interface_the_bounded_handler_overrides() -> None:
    """The threading handler has select(rlist, wlist, xlist, timeout) and create_connection(timeout=...)."""
    handler = kazoo.handlers.threading.SequentialThreadingHandler
    assert callable(handler.select)
    assert callable(handler.create_connection)
    assert {"select", "create_connection"} <= set(dir(kazoo.interfaces.IHandler))


def test_the_connection_names_the_server_it_connects_to_by_address() -> None:
    """The connection passes ``address=(ip, port)`` to the handler (how it avoids a silent server)."""
    source = inspect.getsource(kazoo.protocol.connection.ConnectionHandler._connect)
    assert "self.handler.create_connection(" in source
    assert "address=(hostip, port)" in source


def test_an_os_error_from_the_handler_is_a_dropped_connection() -> None:
    """An OSError in the connection's socket waits becomes ConnectionDropped: kazoo goes to the next server.

    The bounded handler's silence limit raises TimeoutError (an OSError) from ``select`` to get there
    (tested against a real server in ``tests/integration/test_zookeeper_silence.py``).
    """
    connection = kazoo.protocol.connection.ConnectionHandler.__new__(
        kazoo.protocol.connection.ConnectionHandler
    )
    with pytest.raises(kazoo.exceptions.ConnectionDropped):  # noqa: SIM117
        with connection._socket_error_handling():
            raise TimeoutError(110, "the ZooKeeper server sent nothing for 3.0 s")


def test_answers_reach_the_loop_through_rawlink() -> None:
    """Kazoo's async results can be watched with rawlink and read with get_nowait."""
    result = kazoo.handlers.threading.AsyncResult
    assert callable(result.rawlink)
    assert callable(result.get_nowait)


@pytest.mark.parametrize(
    "name",
    ["NoNodeError", "NodeExistsError", "BadVersionError", "NotEmptyError", "NoAuthError", "ConnectionLoss"],
)
def test_exceptions_mapped(name: str) -> None:
    """The exceptions the session passes through or maps are KazooExceptions (so nothing escapes the map)."""
    assert issubclass(getattr(kazoo.exceptions, name), kazoo.exceptions.KazooException)
    assert issubclass(kazoo.exceptions.SessionExpiredError, kazoo.exceptions.KazooException)


def test_acls_built_with_kazoo_security() -> None:
    """ACL entries have perms and id.scheme/id.id, and kazoo's digest agrees with ours."""
    acl = registry_acl("user:secret", world_read=True)
    assert {(a.id.scheme, a.id.id, a.perms) for a in acl} == {
        ("digest", digest_id("user:secret"), kazoo.security.Permissions.ALL),
        ("world", "anyone", kazoo.security.Permissions.READ),
    }
    assert digest_id("user:secret") == kazoo.security.make_digest_acl_credential("user", "secret")
    assert {a.perms for a in shared_acl("user:secret")} == {
        kazoo.security.Permissions.ALL,
        kazoo.security.Permissions.READ | kazoo.security.Permissions.CREATE,
    }
    assert registry_acl(None) == list(kazoo.security.OPEN_ACL_UNSAFE)


def test_requests_in_kazoos_log_are_redacted() -> None:
    """Kazoo's requests are namedtuples of kazoo.*, so the log filter prints the credentials as type only."""
    auth = kazoo.protocol.serialization.Auth(0, "digest", "user:secret")
    connect = kazoo.protocol.serialization.Connect(0, 0, 10_000, 1, b"session-secret", False)
    create = kazoo.protocol.serialization.Create("/x", b"", registry_acl("user:secret"), 0)
    logger = logging.getLogger(f"{zk_session.__name__}.kazoo")
    assert logger.filters, "no redacting filter on the logger kazoo is given"
    for request in (auth, connect, create):
        record = logger.makeRecord(logger.name, logging.DEBUG, __file__, 1, "Sending: %s", (request,), None)
        assert logger.filter(record)  # runs the session's filters over the record
        line = record.getMessage()
        assert "secret" not in line
        assert digest_id("user:secret") not in line
        assert type(request).__name__ in line
