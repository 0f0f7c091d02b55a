"""Suite-wide test setup: Hypothesis profiles, real NATS and PostgreSQL servers, and the secret check.

The secret check: every log record of the session (root logger at DEBUG) and every ``*.log`` file under
the session's temporary directory is searched for the values in ``tests/secret_values.py``; a secret
found anywhere fails the run, with the secret's name and the logger or file (see ``tests/secret_scan.py``).

Servers are real processes (see :mod:`dispenser_lab.servers`). A server that cannot start fails the tests
that need it, with the reason and the server's log; nothing is skipped for want of a server.

Fixtures:
    nats_server: one NATS server for the whole session; don't stop it.
    postgres_server: one PostgreSQL server for the whole session; don't stop it.
    pg_dsn: DSN of a fresh, empty database on ``postgres_server``, dropped after the test.
    private_nats / private_postgres: a server of the test's own, to stop, kill and restart at will.
    zookeeper_server: one ZooKeeper for the whole session; don't stop it. Tests keep apart by using
        their own registry namespace (``zk_namespace``: a registry name no other test uses).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import uvloop
from hypothesis import settings

from dispenser_lab.servers import DevServerError, NatsServer, PostgresServer
from dispenser_lab.servers.server import ServerProcess
from dispenser_lab.servers.zookeeper import ZooKeeperServer
from tests.secret_scan import Leak, SecretScanHandler, scan_log_files
from tests.secret_values import SECRETS

# Hypothesis, three profiles (docs/development.md, "Property tests"):
# ci (scripts/test's default): derandomized, so the examples are a function of the test's code; the same
#   commit draws the same inputs on every machine and run, a red run is a change's doing and reproduces,
#   never a dice roll (as {'A\n': None} was twice, for the AsyncAPI writer). No database: a fresh clone has
#   none, and a developer's must not make their run differ from CI's.
# dev (plain pytest): random, with the local database (.hypothesis/, not in git) replaying what failed.
# explore: random and long, to look for new failures by hand; each one found becomes an @example on its
#   test, which every later run, CI's too, then tries first.
settings.register_profile(
    "ci", deadline=None, max_examples=200, derandomize=True, database=None, print_blob=True
)
settings.register_profile("dev", max_examples=50)
settings.register_profile("explore", deadline=None, max_examples=5000, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


_Server = TypeVar("_Server", bound=ServerProcess[Any])

_OWN_BASETEMP = pytest.StashKey[Path]()


@pytest.hookimpl(tryfirst=True)
def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Async tests run on uvloop, the loop ``serve`` and ``enrich`` run on (``dispenser.runner``).

    Closer to production, and cheaper: the suite is CPU-bound on two cores, and the in-process workers,
    clients and readers spend less CPU per message on uvloop.
    """
    return {"uvloop": uvloop.new_event_loop}


def pytest_configure(config: pytest.Config) -> None:
    """Give the session a temporary directory of its own, unless ``--basetemp`` says where.

    pytest's default, ``/tmp/pytest-of-<user>/pytest-<N>``, keeps the last three sessions' directories and
    deletes older ones when a session starts: a second session on the same machine can delete a running
    one's PostgreSQL data directory under it (seen: "terminating connection because of crash of another
    server process"). xdist workers inherit the controller's directory.
    """
    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        own = Path(tempfile.mkdtemp(prefix="leaf-pytest-"))
        config.option.basetemp = str(own)
        config.stash[_OWN_BASETEMP] = own


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the session's own temporary directory after a passing run (a failing run keeps it to read)."""
    own = config.stash.get(_OWN_BASETEMP, None)
    if own is not None and config.stash.get(_PASSED, False):
        shutil.rmtree(own, ignore_errors=True)


def _started(server: _Server) -> _Server:
    """Start a server, turning a failure into a test failure that says why (never a skip)."""
    try:
        server.start()
    except DevServerError as exc:
        pytest.fail(f"{type(exc).__name__}: {exc}", pytrace=False)
    return server


def _running(server: _Server) -> Iterator[_Server]:
    """Body of a server fixture (``yield from``): yield the started server, stop it afterwards."""
    try:
        yield _started(server)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A NATS server shared by the session, on a free port of 127.0.0.1."""
    yield from _running(NatsServer(tmp_path_factory.mktemp("nats")))


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    """A PostgreSQL server shared by the session; tests get their own database through ``pg_dsn``."""
    yield from _running(PostgresServer(tmp_path_factory.mktemp("postgres") / "data"))


@pytest.fixture(scope="session")
def zookeeper_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeperServer]:
    """A ZooKeeper shared by the session, on a free port of 127.0.0.1 (tickTime 500 ms, sessions ≥ 1 s)."""
    yield from _running(ZooKeeperServer(tmp_path_factory.mktemp("zookeeper")))


_namespaces = itertools.count(1)


@pytest.fixture
def zk_namespace(request: pytest.FixtureRequest) -> str:
    """A registry name of this test's own, e.g. ``n7-test_reuse_after_restart``."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)[:80]
    return f"n{next(_namespaces)}-{slug}"


_database_numbers = itertools.count(1)


@pytest.fixture
def pg_dsn(postgres_server: PostgresServer, request: pytest.FixtureRequest) -> Iterator[str]:
    """DSN of a new empty database on the shared server, named after the test and dropped afterwards."""
    slug = re.sub(r"[^a-z0-9_]+", "_", request.node.name.lower()).strip("_")
    name = f"t{next(_database_numbers)}_{slug}"[:63]
    try:
        dsn = postgres_server.create_database(name)
    except DevServerError as exc:
        pytest.fail(f"could not create database {name!r}: {exc}", pytrace=False)
    yield dsn
    postgres_server.drop_database(name)


@pytest.fixture
def private_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A NATS server for this test alone: stop, kill or restart it (same port) as the test needs."""
    yield from _running(NatsServer(tmp_path / "nats"))


@pytest.fixture(scope="session")
def _postgres_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cleanly stopped, freshly initialised cluster that private servers copy instead of running initdb.

    A copy takes ~0.15 s here, initdb ~0.55 s.
    """
    datadir = tmp_path_factory.mktemp("postgres-template") / "data"
    _started(PostgresServer(datadir)).stop()
    return datadir


@pytest.fixture
def private_postgres(tmp_path: Path, _postgres_template: Path) -> Iterator[PostgresServer]:
    """A PostgreSQL server for this test alone: stop, kill or restart it (same port and data) at will."""
    datadir = tmp_path / "pgdata"
    # PostgresServer gives the copy (made by us, possibly as root) to the server's user when it starts.
    shutil.copytree(_postgres_template, datadir, symlinks=True, ignore=shutil.ignore_patterns("postgres.log"))
    yield from _running(PostgresServer(datadir))


@pytest.fixture(autouse=True)
def _state_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's workers keep their state (segment grants, snowflake cache) in a directory of its own.

    The default state directory is ``$XDG_STATE_HOME/leaf-dispenser``: shared, a worker of one test would
    restore the grants another test's worker remembered (in a database of the same name) into its own.
    """
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))


# The secret check ---------------------------------------------------------------------------------------

_secret_scan = SecretScanHandler(SECRETS)
_BASETEMP = pytest.StashKey[Path]()
_LEAKS = pytest.StashKey[list[Leak]]()
_PASSED = pytest.StashKey[bool]()
_WORKER_LEAKS = pytest.StashKey[list[Leak]]()
_WORKEROUTPUT_KEY = "secret_scan_leaks"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Scan every log record of the session, at every level (a DEBUG line must not leak a secret either)."""
    root = logging.getLogger()
    root.addHandler(_secret_scan)
    root.setLevel(logging.DEBUG)


@pytest.fixture(scope="session", autouse=True)
def _secret_scan_basetemp(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> None:
    """Remember the session's temporary directory: its ``*.log`` files are scanned at the end."""
    pytestconfig.stash[_BASETEMP] = tmp_path_factory.getbasetemp()


@pytest.fixture(autouse=True)
def _secret_scan_stays_on() -> None:
    """Undo what an earlier test did to the root logger (``main()`` sets its level, a test may remove handlers).

    ``main()`` also leaves its stderr handler behind, writing to that test's captured (now closed) stderr:
    every later record would print a "Logging error" traceback. It goes.
    """
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() == "dispenser-cli"]:
        root.removeHandler(handler)
    if _secret_scan not in root.handlers:
        root.addHandler(_secret_scan)
    root.setLevel(logging.DEBUG)


@pytest.hookimpl(trylast=True)  # after the session's fixtures (its servers) were torn down
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fail the run if a secret reached a log record or a log file (the servers have stopped by now).

    Under pytest-xdist each worker scans its own records and files and hands what it found to the
    controller (``workeroutput``, see :func:`pytest_testnodedown`), which fails the run: a worker's exit
    status alone would not.
    """
    logging.getLogger().removeHandler(_secret_scan)
    leaks = _secret_scan.leaks
    basetemp = session.config.stash.get(_BASETEMP, None)
    if basetemp is not None:  # an xdist worker's base directory is its own (<the run's>/gw0, ...)
        leaks += scan_log_files(basetemp, SECRETS)
    from_workers: list[Leak] = session.config.stash.get(_WORKER_LEAKS, [])
    leaks += from_workers
    session.config.stash[_LEAKS] = leaks
    session.config.stash[_PASSED] = session.exitstatus == pytest.ExitCode.OK and not leaks
    # Set on an xdist worker only: what its controller receives when the worker finishes.
    workeroutput: dict[str, object] | None = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput[_WORKEROUTPUT_KEY] = [(leak.secret, leak.where) for leak in leaks]
    if leaks:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if session.config.pluginmanager.get_plugin("terminalreporter") is None:
            print("\n".join(f"SECRET LEAKED: {leak}" for leak in leaks), file=sys.stderr)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """(xdist controller) Take in what a finished worker's secret scan found."""
    found = getattr(node, "workeroutput", {}).get(_WORKEROUTPUT_KEY, [])
    leaks = node.config.stash.setdefault(_WORKER_LEAKS, [])
    leaks.extend(Leak(secret, where) for secret, where in found)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Name every leaked secret (never its value) and where it was found."""
    leaks = config.stash.get(_LEAKS, [])
    if leaks:
        terminalreporter.section("secrets leaked into logs: the run fails", red=True, bold=True)
        for leak in leaks:
            terminalreporter.write_line(f"SECRET LEAKED: {leak}", red=True)


# Stages ---------------------------------------------------------------------------------------------------

LONG_TESTS = (
    # Each over ~9 s of its own on an idle 2-core machine (fresh-clone run of 2026-11-25, --durations), and
    # the slowest others when the suite outgrows its budget (below): they run in CI's second stage (.ci/run: `scripts/test -m long`), with the clustered suite (tests/ha), so
    # that `scripts/test`, the suite developers wait on, stays under 4 minutes.
    "tests/integration/test_kafka_restarts.py",
    # Leaf's 39 captured requests (three unknown tags, each waiting for the store's refresh) and a JVM of
    # Java callers: ~9 s.
    "tests/integration/test_leaf_answers.py",
    "tests/integration/test_kafka_enrich_stop.py",
    "tests/integration/test_datacenters.py",
    "tests/integration/test_wheel.py",
    "tests/integration/test_bench.py",
    "tests/integration/test_bench_http.py",
    "tests/integration/test_bench_alternatives.py",
    "tests/integration/test_dev_command.py::test_dev_with_kafka_serves_over_the_request_topic",
    "tests/integration/test_dev_command.py::test_dev_with_two_datacenters_serves_callers_in_each",
    "tests/integration/test_kafka_enrich.py::test_exactly_once_through_three_sigkills",
    "tests/integration/test_kafka_enrich.py::test_an_enricher_killed_during_a_rebalance",
    "tests/integration/test_rates.py::test_steady_load_sizes_segments_to_s_times_r",
    "tests/integration/test_rates.py::test_the_database_gone_at_the_worst_moment",
    "tests/integration/test_kafka_requests.py::test_broker_down_while_serving_then_back",
    "tests/integration/test_kafka_server.py::test_restart_keeps_ports_and_data_and_kill_is_survived",
    "tests/integration/test_client_buffer.py::test_eight_clients_draw_a_million_ids_each_through_a_worker_kill",
    # Moved on 2026-11-28, when issues 30-32 had added ~260 tests and stage 1 took 216 s of pytest on an idle
    # machine (over 4 minutes with the install and the static checks): the slowest of stage 1 (4-7 s each,
    # --durations), ~75 s of test time. Each is a fault or a server's edge case that CI's second stage runs
    # on every submission all the same.
    "tests/integration/test_slow_postgres.py::test_a_slow_postgres_costs_fetches_not_buffered_requests",
    "tests/integration/test_postgres_hung_host.py::test_the_first_request_at_start_is_answered_within_its_deadline_while_postgres_never_answers",
    "tests/integration/test_leaf_zookeeper_layout.py::test_dispenser_workers_take_the_next_ids_beside_leafs_and_leaf_can_read_their_nodes",
    "tests/integration/test_snowflake_workers.py::test_crash_then_restart_with_clock_back_never_repeats",
    "tests/integration/test_zookeeper_registry.py::test_a_reconnect_that_gets_no_handshake_answer_is_retried",
    "tests/integration/test_zookeeper_registry.py::test_partitioned_holder_stops_before_its_id_can_be_taken",
    "tests/integration/test_zookeeper_registry.py::test_lease_survives_a_short_zookeeper_restart",
    "tests/integration/test_kafka_security.py",
    "tests/integration/test_nats_auth.py::test_documented_permissions_authorise_per_tag",
    "tests/integration/test_leaf_live_node.py::test_a_worker_given_a_live_leaf_servers_address_refuses_its_worker_id",
)
"""Node ID prefixes of the tests marked ``long`` (besides every test in ``tests/ha/``)."""


@pytest.hookimpl(tryfirst=True)
def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark ``long`` the tests of :data:`LONG_TESTS` and of ``tests/ha/``, before ``-m`` selects."""
    if item.nodeid.startswith(("tests/ha/", *LONG_TESTS)):
        item.add_marker(pytest.mark.long)


# Order ----------------------------------------------------------------------------------------------------


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Start the long tests first: those marked ``ha`` (see :func:`pytest_xdist_make_scheduler`) or ``slow``.

    Otherwise in the order collected. Under pytest-xdist the long ones then start at once and the other
    worker takes the many short ones; one started last would keep its worker busy alone at the end.
    """
    items.sort(
        key=lambda item: (item.get_closest_marker("ha") is None, item.get_closest_marker("slow") is None)
    )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """(xdist controller) Hand tests out one at a time as workers free up, but ``tests/ha/`` as one unit.

    The cluster tests share session-scoped clusters (Patroni, three Kafka brokers, a ZooKeeper ensemble,
    routed NATS servers): on one worker, only that worker starts them. (``--dist loadgroup`` with
    ``xdist_group`` markers would say the same, but pytest-xdist 3.8 cannot rename pytest 9's node IDs,
    so its groups are silently ignored.) Work units go out largest first (the cluster tests), then in
    collection order; a worker gets another when it has two tests or fewer left.
    """
    from xdist.scheduler import LoadScopeScheduling  # noqa: PLC0415 - only under xdist

    class _ClusterTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "tests/ha" if nodeid.startswith("tests/ha/") else nodeid

    return _ClusterTestsTogether(config, log)
