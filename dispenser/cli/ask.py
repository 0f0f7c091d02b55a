"""The ``dispenser`` commands that ask: ``get``, ``watch``, ``check`` and ``decode``.

IDs from a running worker, the rate events on NATS, every dependency the configuration names, and a
snowflake ID taken apart with the configured layout.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

import msgspec

from dispenser.arguments import positive_float, positive_int
from dispenser.cli.common import AddParser, uvloop_suits
from dispenser.config import Config
from dispenser.runner import run_async

if TYPE_CHECKING:
    from dispenser.messages import ReplyFormat

__all__ = [
    "add_check",
    "add_decode",
    "add_get",
    "add_watch",
    "run_check",
    "run_decode",
    "run_get",
    "run_watch",
]


def add_get(add_parser: AddParser) -> None:
    """``dispenser get``: the tag, how many, their form, and which broker to ask over."""
    get = add_parser(
        "get",
        help="ask the running service for IDs and print them, one per line",
        description="Ask a running worker for IDs (over NATS, or Kafka with --via kafka) and print them.",
    )
    get.add_argument("tag", help="the tag (segment: created with `dispenser tag add`; snowflake: any name)")
    get.add_argument("count", type=positive_int, nargs="?", default=1, help="how many IDs (default 1)")
    form = get.add_mutually_exclusive_group()
    form.add_argument("--ranges", action="store_true", help="ask for ranges; print 'first last' per line")
    form.add_argument(
        "--sqids", action="store_true", help="ask for each ID as its 12-character string (docs/permuted.md)"
    )
    get.add_argument(
        "--kind", choices=["segment", "snowflake"], default="segment", help="generator (default segment)"
    )
    get.add_argument("--request-id", help="idempotency key: a retry returns the same IDs")
    get.add_argument(
        "--timeout",
        type=positive_float,
        default=5.0,
        help="seconds to wait for the reply, connecting included (default 5)",
    )
    get.add_argument(
        "--via",
        choices=["nats", "kafka"],
        default="nats",
        help="ask over NATS (default) or the Kafka request topic",
    )


def add_watch(add_parser: AddParser) -> None:
    """``dispenser watch``: once or live, as a table or JSON lines."""
    watch = add_parser(
        "watch",
        help="live view of every tag's rate, peak, step, buffers and runway (from the rate events on NATS)",
    )
    watch.add_argument("--once", action="store_true", help="listen for one event interval, print one table")
    watch.add_argument("--json", action="store_true", help="print every rate event as a JSON line")
    watch.add_argument(
        "--timeout",
        type=positive_float,
        default=5.0,
        help="seconds to wait for NATS before giving up (default 5)",
    )


def add_check(add_parser: AddParser) -> None:
    """``dispenser check``: no options of its own, it checks what the configuration names."""
    add_parser(
        "check",
        help="check that every dependency can be reached; non-zero exit names failures",
        description=(
            "Try every dependency the configuration names (NATS, PostgreSQL and its schema, ZooKeeper or "
            "the snowflake registry, Kafka) and print one line each: ok, or FAIL with the cause. Exits 1 "
            "if any failed. Use it in a deployment's pre-flight, or to find out why a worker will not start."
        ),
    )


def add_decode(add_parser: AddParser) -> None:
    """``dispenser decode``: one snowflake ID, or with ``--tag`` one permuted tag's ID."""
    decode = add_parser(
        "decode",
        help="take a snowflake ID apart (time, datacenter, worker, sequence) with the configured layout, "
        "or with --tag a permuted tag's ID (its key epoch and counter, with the key file)",
    )
    decode.add_argument(
        "id",
        help="a snowflake ID (with --tag: a permuted tag's ID), in decimal or as its 12-character string of "
        "the sqids format",
    )
    decode.add_argument(
        "--tag",
        help="a permuted tag: decode with its key file in segment.permute_keys_dir (docs/permuted.md)",
    )


def run_get(args: argparse.Namespace, config: Config) -> int:
    """Ask a worker over NATS (or Kafka) and print its IDs, or its error (exit 1)."""
    from dispenser.adapters.nats.client_transport import request_once  # noqa: PLC0415
    from dispenser.messages import Reply, id_subject  # noqa: PLC0415

    body: dict[str, Any] = {"count": args.count}
    form: ReplyFormat = "ranges" if args.ranges else "sqids" if args.sqids else "ids"
    if form != "ids":
        body["format"] = form
    if args.request_id:
        body["request_id"] = args.request_id
    subject = id_subject(config.nats.subject_prefix, args.kind, args.tag)

    async def ask_kafka() -> Reply:
        from dispenser.client import KafkaIdClient  # noqa: PLC0415 - imports aiokafka

        async with KafkaIdClient(config.kafka, timeout=args.timeout) as client:
            try:
                return await client.request(
                    args.tag,
                    args.count,
                    kind=args.kind,
                    format=form,
                    request_id=args.request_id,
                )
            except TimeoutError:
                raise OSError(
                    f"no reply on {config.kafka.reply_topic!r} within {args.timeout}s (is a worker serving "
                    f"{config.kafka.request_topic!r} on {config.kafka.bootstrap_servers}?)"
                ) from None

    async def ask() -> Reply:
        data = await request_once(
            config.nats, subject, msgspec.json.encode(body), args.timeout, "dispenser-get"
        )
        return msgspec.json.decode(data, type=Reply)

    reply = run_async(ask_kafka() if args.via == "kafka" else ask(), fast=uvloop_suits(config))
    if reply.error is not None:
        retry = " (retryable)" if reply.error.retryable else ""
        print(f"dispenser: {reply.error.code}: {reply.error.message}{retry}", file=sys.stderr)
        return 1
    out = sys.stdout
    if reply.ranges is not None:
        out.writelines(f"{first} {last}\n" for first, last in reply.ranges)
    elif reply.ids is not None:
        out.writelines(f"{i}\n" for i in reply.ids)
    elif reply.sqids is not None:
        out.writelines(f"{s}\n" for s in reply.sqids)
    return 0


def run_watch(args: argparse.Namespace, config: Config) -> int:
    """Show the rate events (``dispenser.watch``)."""
    from dispenser.watch import run_watch  # noqa: PLC0415

    return run_async(run_watch(config, once=args.once, as_json=args.json, timeout=args.timeout))


def run_check(_args: argparse.Namespace, config: Config) -> int:
    """Print a line per dependency; exit 1 if any cannot be reached."""
    from dispenser.health import check_all  # noqa: PLC0415

    results = run_async(check_all(config), fast=uvloop_suits(config))
    failed = [r for r in results if not r.ok]
    for result in results:
        print(f"{'ok  ' if result.ok else 'FAIL'} {result.name}: {result.detail}")
        if result.warning:
            print(f"WARN {result.name}: {result.warning}")
    if failed:
        print(f"dispenser: cannot reach {', '.join(r.name for r in failed)}", file=sys.stderr)
        return 1
    return 0


def run_decode(args: argparse.Namespace, config: Config) -> int:
    """Print the parts of a snowflake ID, or a permuted tag's key epoch and counter (``--tag``)."""
    from dispenser.registries import layout_of  # noqa: PLC0415
    from dispenser.service.decode import decode_id  # noqa: PLC0415

    value = _id_of(args.id)
    if args.tag is not None:
        return _decode_permuted(args.tag, value, config)
    reply = decode_id(layout_of(config.snowflake), value)
    print(f"id:        {reply.id}")
    print(f"time:      {reply.time}  ({reply.timestamp_ms} ms since 1970)")
    if reply.datacenter_id is not None:
        print(f"datacenter: {reply.datacenter_id}")
    print(f"worker:    {reply.worker_id}")
    print(f"sequence:  {reply.sequence}")
    return 0


def _id_of(text: str) -> int:
    """An ID in decimal (a negative one too: the decoder says why it is none), or its sqids-format string.

    The sqids package (the [server] extra) is imported for a string only: a client-only install decodes
    decimal snowflake IDs as before.
    """
    if text.isascii() and text.removeprefix("-").isdigit():
        return int(text)
    from dispenser.core.sqids_form import from_sqid  # noqa: PLC0415

    return from_sqid(text)


def _decode_permuted(tag: str, permuted_id: int, config: Config) -> int:
    """Print a permuted tag's ID's key epoch and counter, read with the tag's key file."""
    from dispenser.core.errors import BadRequest  # noqa: PLC0415
    from dispenser.service.permuted import load_permutation  # noqa: PLC0415

    directory = config.segment.permute_keys_dir
    if directory is None:
        raise BadRequest("segment.permute_keys_dir is not set: no tag is permuted")
    epoch, counter = load_permutation(directory, tag).decode(permuted_id)
    print(f"id:        {permuted_id}")
    print(f"tag:       {tag}")
    print(f"key epoch: {epoch}")
    print(f"counter:   {counter}")
    return 0
