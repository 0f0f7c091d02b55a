"""Apache ZooKeeper (kazoo): the shared session, Leaf's persistent worker IDs and recyclable leases.

Its face (the modules used from outside); ``bridge``, ``handler``, ``handshake`` and ``kazoo_log`` are the
session's parts.
"""

__all__ = ["acl", "lease", "registry", "session"]
