"""Where a benchmark runs: here (``--local``, servers and a worker started by the bench) or a deployment.

A deployment is named by ``--nats-url`` and needs ``--tag`` or ``--create-tag`` (the operator's consent to
lose its IDs); the default stays local. See ``docs/benchmarks.md`` ("Local or a deployment").
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from dispenser_lab.bench.errors import BenchError

__all__ = ["Deployment", "add_target_options", "check_answers", "deployment_of", "deployment_tag"]


@dataclass(frozen=True, slots=True)
class Deployment:
    """A deployment to measure: its NATS, the tag to take IDs from, and whether the bench creates it."""

    nats_url: str
    tag: str
    create_dsn: str | None = None
    """The deployment's PostgreSQL when the bench creates (and then removes) the tag."""


def add_target_options(parser: argparse.ArgumentParser) -> None:
    """``--local``, ``--tag`` and ``--create-tag`` (``--nats-url``/``--postgres-dsn`` are the bench's own)."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--local",
        action="store_true",
        help="start NATS, PostgreSQL (unless --nats-url/--postgres-dsn) and a worker here (the default)",
    )
    where.add_argument(
        "--tag",
        metavar="TAG",
        help="measure the deployment at --nats-url (nothing started) on this existing tag; the IDs taken are "
        "lost to its users",
    )
    where.add_argument(
        "--create-tag",
        metavar="TAG",
        help="as --tag, on a tag added to the deployment's database (--postgres-dsn) and removed after",
    )


def deployment_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Deployment | None:
    """The deployment the arguments name, or ``None`` for a local run; a usage error if they do not add up."""
    tag = args.tag or args.create_tag
    if tag is None:
        return None
    if not args.nats_url:
        parser.error("--tag and --create-tag measure a deployment: give its --nats-url")
    if args.create_tag is not None and not args.postgres_dsn:
        parser.error("--create-tag adds the tag to the deployment's database: give its --postgres-dsn")
    if args.tag is not None and args.postgres_dsn:
        parser.error("--tag uses an existing tag: no --postgres-dsn (or use --create-tag)")
    return Deployment(args.nats_url, tag, args.postgres_dsn if args.create_tag is not None else None)


@contextlib.contextmanager
def deployment_tag(deployment: Deployment, step: int) -> Iterator[str]:
    """The tag to measure on: created with ``step`` and removed after, when the bench creates it."""
    from dispenser.runner import run_async  # noqa: PLC0415
    from dispenser_lab.bench.servers import prepare_tags, remove_tags  # noqa: PLC0415 - needs asyncpg

    if deployment.create_dsn is None:
        yield deployment.tag
        return
    tags = [(deployment.tag, step, 1)]
    try:
        run_async(prepare_tags(deployment.create_dsn, tags, migrate=False))
    except Exception as exc:  # the store's error names what went wrong: an existing tag, no access
        raise BenchError(f"cannot create the tag {deployment.tag!r}: {exc}") from exc
    try:
        yield deployment.tag
    finally:
        run_async(remove_tags(deployment.create_dsn, tags))


async def check_answers(nc: Client, subject: str, body: bytes, timeout: float) -> bytes:
    """One request on ``subject``: the reply's body, or a :class:`BenchError` saying why there is none."""
    try:
        msg = await nc.request(subject, body, timeout=timeout)
    except NoRespondersError as exc:
        raise BenchError(f"no worker answers on {subject} (is the subject prefix right?)") from exc
    except NatsTimeout as exc:
        raise BenchError(f"no reply on {subject} within {timeout:g} s") from exc
    if msg.headers:
        raise BenchError(f"the deployment answered {subject} with an error: {msg.headers} {msg.data[:300]!r}")
    return msg.data
