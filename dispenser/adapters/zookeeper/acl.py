"""Digest credentials and the ACLs of the nodes a registry creates.

Every node from the namespace ``<root>/<name>`` down gets :func:`registry_acl` (all permissions for the
configured identity, read for anyone if asked); the shared ancestors (``/leaf``, ``/leaf/snowflake``) get
:func:`shared_acl`, so other identities can create their own namespaces there. Neither the credentials nor
the digest derived from them are ever logged.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import kazoo.security  # type: ignore[import-untyped]  # kazoo has no type hints

__all__ = ["acl_set", "check_auth", "describe_acl", "digest_id", "registry_acl", "shared_acl"]


def check_auth(auth: str) -> str:
    """Validate digest credentials ``user:password`` (the message never repeats them).

    Raises:
        ValueError: no ``:``, or an empty user or password.
    """
    user, sep, password = auth.partition(":")
    if not sep or not user or not password:
        raise ValueError("ZooKeeper credentials must look like user:password (both non-empty)")
    return auth


def digest_id(auth: str) -> str:
    """The ACL identity ZooKeeper derives from digest credentials: ``user:base64(sha1(user:password))``.

    This is what ``DigestAuthenticationProvider.generateDigest`` computes; it is not the password, but a
    weak password can be guessed from it, so it is not logged either.
    """
    user = check_auth(auth).partition(":")[0]
    # SHA-1 because that is the scheme's definition, not a choice of ours.
    return f"{user}:{base64.b64encode(hashlib.sha1(auth.encode()).digest()).decode()}"


def registry_acl(auth: str | None, *, world_read: bool = True) -> list[Any]:
    """The ACL of the nodes of a registry namespace: everything for ``auth``'s identity, read for anyone.

    Args:
        auth: ``user:password``; None: no credentials, so the nodes are open to anyone.
        world_read: Let anyone read the nodes and list their children (``world:anyone`` READ).
    """
    if auth is None:
        return list(kazoo.security.OPEN_ACL_UNSAFE)
    acl = [_digest_all(auth)]
    if world_read:
        acl.append(kazoo.security.make_acl("world", "anyone", read=True))
    return acl


def shared_acl(auth: str | None) -> list[Any]:
    """The ACL of the ancestors a registry creates above its namespace (``/leaf``, ``/leaf/snowflake``).

    Anyone may read them and create children (other teams' namespaces, with other credentials); only
    ``auth``'s identity may change, delete under or re-ACL them.
    """
    if auth is None:
        return list(kazoo.security.OPEN_ACL_UNSAFE)
    return [_digest_all(auth), kazoo.security.make_acl("world", "anyone", read=True, create=True)]


def _digest_all(auth: str) -> Any:
    return kazoo.security.make_acl("digest", digest_id(auth), all=True)


def acl_set(acl: list[Any]) -> set[tuple[str, str, int]]:
    """An ACL as comparable ``(scheme, id, perms)`` triples."""
    return {(a.id.scheme, a.id.id, int(a.perms)) for a in acl}


def describe_acl(acl: list[Any]) -> str:
    """An ACL for a log line: schemes and permissions only."""
    # Schemes and permissions only: a digest ID is a hash of its password.
    return ", ".join(
        f"{a.id.scheme}:{'anyone' if a.id.scheme == 'world' else '…'}={int(a.perms)}" for a in acl
    )
