"""Every password, token and key material the test suite uses, in one place.

The suite-wide log check (``tests/conftest.py``) fails the run if any of these strings reaches a log line,
so a test that needs a secret takes it from here (or adds it here) rather than inventing one inline.
"""

from __future__ import annotations

__all__ = ["SECRETS"]

SECRETS: dict[str, str] = {}
"""Name → secret value. Values must be long and unlikely to appear in logs by chance."""

# PostgreSQL over TLS, ZooKeeper digest ACLs (tests/integration/test_postgres_tls.py, test_zookeeper_acl.py)
SECRETS["postgres_password"] = "pg-Tls-2f8c1e9a7b4d-secret"
SECRETS["zookeeper_password"] = "zk-Digest-5e0b7c3a9f12-secret"
SECRETS["zookeeper_wrong_password"] = "zk-Wrong-81d4a6c2e7b0-secret"

# NATS credentials (tests/integration/test_nats_auth.py, test_no_secret_leaks.py)
SECRETS["nats_password"] = "nats-Pass-393bc3c3645b-secret"
SECRETS["nats_token"] = "nats-Token-6aebab27c3f4-secret"
SECRETS["nats_nkey_seed"] = "SUAPOEISDXDYXJWE4W3CPKTGVDY3WTNHIVTFEH4AXFPFNDQYSDQV2DQTVA"
"""A user nkey seed (the public key is derived from it by the test)."""
SECRETS["nats_dispenser_password"] = "nats-Worker-5e5b78e35a20-secret"
SECRETS["nats_orders_password"] = "nats-Orders-962191714444-secret"
SECRETS["nats_ops_password"] = "nats-Ops-0813f0fd70ec-secret"
SECRETS["check_postgres_password"] = "pg-Check-7c1d0e93b5a2-secret"
"""In the DSN of a trust-auth test server: accepted unused, so it can only show up where it leaked."""

# Kafka SASL/SCRAM over TLS (tests/integration/test_kafka_security.py)
SECRETS["kafka_scram_password"] = "kafka-Scram-4d71b0e9c2a6-secret"
SECRETS["kafka_wrong_password"] = "kafka-Wrong-b83f05d2e917-secret"

# Leaf's MySQL (MariaDB) user for `dispenser import-leaf` (tests/integration/test_leaf_import.py)
SECRETS["leaf_mysql_password"] = "my-Leaf-6a0e93c1d7b4-secret"
SECRETS["leaf_mysql_wrong_password"] = "my-Wrong-2c8f51e0a9d3-secret"

# The DSN of an unreachable PostgreSQL (tests/integration/test_unavailable_bodies.py)
SECRETS["whereabouts_postgres_password"] = "pg-Where-4b9e2d71c0a8-secret"

# Permuted tags' keys (tests/integration/test_permuted.py): AES keys in hex, in the tag's key file
SECRETS["permute_key"] = "5ec7e7a1b2c3d4e5f60718293a4b5c6d"
SECRETS["permute_key_rotated"] = "9f8e7d6c5b4a39281706f5e4d3c2b1a0aa55cc33ee11dd22bb44ff6699887766"
