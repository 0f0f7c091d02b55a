"""The baseline responder: a trivial NATS echo service in a process of its own.

``python -m dispenser_lab.bench.echo --url nats://127.0.0.1:4222 --subject 'leaf.echo.>' --queue leaf``

A plain nats-py subscription in a queue group whose callback answers every request with its own body,
on uvloop: the fastest a Python responder on nats-py can be, and so the ceiling the dispenser is
measured against. It runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence

import nats
from nats.aio.msg import Msg

__all__ = ["main", "serve"]


async def serve(url: str, subject: str, queue: str, sized_subject: str | None = None) -> None:
    """Answer requests on ``subject`` with their own body until SIGTERM or SIGINT.

    On ``sized_subject`` (a wildcard such as ``leaf.echo-sized.>``), answer with a canned body of as many
    bytes as the subject's last token says: ``leaf.echo-sized.1700`` gets 1,700 bytes back.
    """
    nc = await nats.connect(url, name="dispenser-bench-echo")

    async def echo(msg: Msg) -> None:
        await msg.respond(msg.data)

    await nc.subscribe(subject, queue=queue, cb=echo)
    if sized_subject is not None:
        bodies: dict[str, bytes] = {}

        async def sized(msg: Msg) -> None:
            subject = msg.subject
            body = bodies.get(subject)
            if body is None:
                size = int(subject.rpartition(".")[2])
                body = bodies[subject] = b"x" * size
            await msg.respond(body)

        await nc.subscribe(sized_subject, queue=queue, cb=sized)
    await nc.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    with contextlib.suppress(Exception):
        await nc.drain()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments and serve on uvloop."""
    parser = argparse.ArgumentParser(prog="python -m dispenser_lab.bench.echo", description=__doc__)
    parser.add_argument("--url", required=True, help="NATS server URL")
    parser.add_argument("--subject", required=True, help="subject to answer, wildcards allowed")
    parser.add_argument("--queue", default="leaf", help="queue group")
    parser.add_argument(
        "--sized-subject", help="subject (wildcard) answered with a body of the size it ends in"
    )
    args = parser.parse_args(argv)
    try:
        import uvloop  # noqa: PLC0415 - a dependency everywhere we run; plain asyncio otherwise
    except ImportError:  # pragma: no cover
        asyncio.run(serve(args.url, args.subject, args.queue, args.sized_subject))
    else:
        uvloop.run(serve(args.url, args.subject, args.queue, args.sized_subject))
    return 0


if __name__ == "__main__":
    sys.exit(main())
