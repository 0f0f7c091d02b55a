"""One request, every reply: the scatter-gather that the peer and residue checks make over NATS.

A request goes out with a fresh inbox as its reply subject; every worker listening answers, and the answers
are gathered until a window ends, the caller has enough, or the server says "no responders".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.msg import Msg

__all__ = ["gather_replies", "is_no_responders"]


def is_no_responders(msg: Msg) -> bool:
    """Whether ``msg`` is the server's "no responders" status: an empty message with a 503 Status header."""
    return not msg.data and msg.headers is not None and msg.headers.get("Status") == "503"


async def gather_replies(
    nc: Client, subject: str, body: bytes, window: float, on_reply: Callable[[Msg], bool]
) -> bool:
    """Publish ``body`` on ``subject`` and hand each reply arriving within ``window`` seconds to ``on_reply``.

    ``on_reply`` sees every reply with data, as it arrives, and returns True to stop listening. Other empty
    messages are passed over; the server's "no responders" ends the gathering at once, since nothing was
    delivered: no answer can follow.

    Returns:
        Whether anything answered: a reply, or the server's "no responders" (nobody listens). False means the
        request went unheard (no permission on the subject or the inbox, or a slow server).
    """
    inbox = nc.new_inbox()
    answered = False
    subscription = await nc.subscribe(inbox)
    try:
        await nc.publish(subject, body, reply=inbox)
        loop = asyncio.get_running_loop()
        end = loop.time() + window
        while (left := end - loop.time()) > 0:
            try:
                msg = await subscription.next_msg(timeout=left)
            except TimeoutError:
                break
            answered = True
            if not msg.data:
                if is_no_responders(msg):
                    break  # nobody listens: nothing more will come
                continue
            if on_reply(msg):
                break
    finally:
        await subscription.unsubscribe()
    return answered
