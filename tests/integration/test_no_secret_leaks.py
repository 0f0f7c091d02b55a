"""No secret reaches a reply: not ``$SRV.INFO``/``STATS``/``PING``, not an error reply, not ``dispenser check``.

(Logs are covered for the whole suite by the secret check in ``tests/conftest.py``.)
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import nats
import pytest
from nats.aio.msg import Msg

from dispenser.adapters.postgres.schema import migrate
from dispenser.cli import main
from dispenser.config import load_config
from dispenser.messages import Reply
from dispenser_lab.servers import NatsServer, PostgresServer, free_port
from tests.secret_scan import find_secrets
from tests.secret_values import SECRETS

from .segment_support import ask, ids_of, prepare, request, running_worker

pytestmark = [pytest.mark.nats, pytest.mark.postgres]

PASSWORD = SECRETS["nats_password"]
TOKEN = SECRETS["nats_token"]
PG_PASSWORD = SECRETS["check_postgres_password"]


def _with_password(dsn: str) -> str:
    """``postgresql://postgres@…`` → ``postgresql://postgres:<secret>@…`` (the test server trusts anyway)."""
    scheme, rest = dsn.split("://", 1)
    user, host = rest.split("@", 1)
    return f"{scheme}://{user}:{PG_PASSWORD}@{host}"


def _password_server(workdir: Path) -> NatsServer:
    return NatsServer(
        workdir, config="authorization { user: leaf, password: $LEAF_PASS }", env={"LEAF_PASS": PASSWORD}
    )


def _whole(msg: Msg) -> str:
    """A reply as the client sees it: body and headers."""
    return f"{msg.data.decode(errors='replace')} {msg.headers!r}"


def assert_no_secret(text: str, what: str) -> None:
    """Fail naming the secrets (not their values) that ``text`` holds."""
    leaked = find_secrets(text, SECRETS)
    assert not leaked, f"{what} holds the secret(s) {leaked}"


async def test_discovery_and_error_replies_hold_no_secret(
    private_postgres: PostgresServer, tmp_path: Path
) -> None:
    """With a password for NATS and in the DSN: discovery, error replies and STATS show neither."""
    dsn = _with_password(private_postgres.dsn)
    await prepare(dsn, [("order", 10)])
    env = {
        "DISPENSER_NATS_USER": "leaf",
        "DISPENSER_NATS_PASSWORD": PASSWORD,
        "DISPENSER_POSTGRES_DSN": dsn,
        "DISPENSER_POSTGRES_COMMAND_TIMEOUT": "0.5",
        "DISPENSER_SEGMENT_FETCH_DEADLINE": "1.0",
        "DISPENSER_RATE_ENABLED": "false",
        # Segments of the configured 10 IDs: on a slow machine the adaptive step measured the first two
        # requests' rate and buffered hundreds, so the 50-ID request after the stop was served from them.
        "DISPENSER_RATE_ADAPTIVE_STEP": "false",
    }
    with _password_server(tmp_path / "nats") as server:
        config = load_config(environ=env | {"DISPENSER_NATS_URL": server.url})
        async with running_worker(config):
            nc = await nats.connect(server.url, user="leaf", password=PASSWORD)
            try:
                assert ids_of(await ask(nc, "leaf.segment.order", b'{"count": 2}')) == [1, 2]
                unknown = await request(nc, "leaf.segment.nope")
                assert_no_secret(_whole(unknown), "the unknown-tag error reply")
                # The store goes away: a request beyond the buffered IDs gets a "store unavailable" error,
                # whose message carries the driver's error (where a DSN could have slipped in).
                private_postgres.stop()
                down = await request(nc, "leaf.segment.order", b'{"count": 50}')
                error = msgspec.json.decode(down.data, type=Reply).error
                assert error is not None
                assert error.code == "unavailable", error
                assert_no_secret(_whole(down), "the store-unavailable error reply")
                for verb in ("PING", "INFO", "STATS"):
                    answer = await request(nc, f"$SRV.{verb}.leaf-dispenser")
                    assert_no_secret(_whole(answer), f"$SRV.{verb}")
                stats = msgspec.json.decode((await request(nc, "$SRV.STATS.leaf-dispenser")).data)
                assert any(e["last_error"] for e in stats["endpoints"])  # the error is there, the DSN is not
            finally:
                await nc.close()


def test_check_output_holds_no_secret(
    pg_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dispenser check` with credentials in the config and in URLs: masked whether it succeeds or fails."""
    for name in ("DISPENSER_NATS_URL", "DISPENSER_POSTGRES_DSN", "DISPENSER_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    dsn = _with_password(pg_dsn)
    asyncio.run(migrate(dsn))
    token_config = "authorization { token: $LEAF_TOKEN }"
    with (
        _password_server(tmp_path / "nats-password") as password_server,
        NatsServer(tmp_path / "nats-token", config=token_config, env={"LEAF_TOKEN": TOKEN}) as token_server,
    ):
        closed = free_port()
        cases = {
            "password-fields": (
                f'[nats]\nurl = "{password_server.url}"\nuser = "leaf"\npassword = "{PASSWORD}"\n',
                0,
            ),
            "password-in-url": (
                f'[nats]\nurl = "nats://leaf:{PASSWORD}@127.0.0.1:{password_server.port}"\n',
                0,
            ),
            "token-field": (f'[nats]\nurl = "{token_server.url}"\ntoken = "{TOKEN}"\n', 0),
            "token-in-url": (f'[nats]\nurl = "nats://{TOKEN}@127.0.0.1:{token_server.port}"\n', 0),
            "wrong-password": (
                f'[nats]\nurl = "{password_server.url}"\nuser = "leaf"\npassword = "{TOKEN}"\n'
                "connect_timeout = 2\n",
                1,
            ),
            "nothing-listening": (
                f'[nats]\nurl = "nats://leaf:{PASSWORD}@127.0.0.1:{closed},nats://{TOKEN}@127.0.0.1:{closed}"\n'
                "connect_timeout = 1\n",
                1,
            ),
        }
        for case, (nats_section, status) in cases.items():
            postgres = dsn if status == 0 else _with_password(f"postgresql://postgres@127.0.0.1:{closed}/x")
            path = tmp_path / f"{case}.toml"
            path.write_text(f'{nats_section}[postgres]\ndsn = "{postgres}"\n')
            assert main(["-c", str(path), "check"]) == status, (case, capsys.readouterr())
            out, err = capsys.readouterr()
            assert ("FAIL" in out) == (status != 0), (case, out)
            assert_no_secret(out + err, f"`dispenser check` ({case})")
