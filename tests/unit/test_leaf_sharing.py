"""snowflake.zookeeper_root: Leaf's root is shared only in ways that keep Leaf's and our worker IDs apart."""

from __future__ import annotations

from typing import Any

import pytest

from dispenser.config import ConfigError, SnowflakeConfig, load_config
from dispenser.core.errors import InvalidLayout
from dispenser.registries import LEAF_ROOT, check_leaf_sharing


def leaf_shared(**overrides: Any) -> SnowflakeConfig:
    return SnowflakeConfig(**{"mode": "zookeeper", "zookeeper_root": LEAF_ROOT, **overrides})


def test_the_root_is_configurable_and_checked() -> None:
    assert load_config(environ={}).snowflake.zookeeper_root == "/leaf/snowflake"
    config = load_config(environ={"DISPENSER_SNOWFLAKE_ZOOKEEPER_ROOT": "/snowflake"})
    assert config.snowflake.zookeeper_root == "/snowflake"
    for bad in ("snowflake", "/snowflake/", "/", "//x", "/a b"):
        with pytest.raises(ConfigError, match="zookeeper_root"):
            load_config(environ={"DISPENSER_SNOWFLAKE_ZOOKEEPER_ROOT": bad})


def test_leafs_root_with_leafs_layout_and_an_ip_port_address_is_accepted() -> None:
    check_leaf_sharing(leaf_shared(), "10.0.0.9:9000")
    check_leaf_sharing(
        leaf_shared(epoch_ms=1_500_000_000_000), "10.0.0.9:9000"
    )  # the worker field alone separates


@pytest.mark.parametrize(
    ("config", "address", "message"),
    [
        (leaf_shared(mode="zookeeper-lease"), "10.0.0.9:9000", "mode 'zookeeper'"),
        (leaf_shared(worker_bits=9, sequence_bits=13), "10.0.0.9:9000", "Leaf's layout 41 \\+ 10 \\+ 12"),
        (leaf_shared(datacenter_bits=2, worker_bits=8), "10.0.0.9:9000", "without a datacenter field"),
        (leaf_shared(zookeeper_auth="leaf:pw"), "10.0.0.9:9000", "zookeeper_auth would lock Leaf"),
        (leaf_shared(), "web-1:3fa2c0de", "an address without '-'"),
    ],
)
def test_what_would_break_sharing_is_refused(config: SnowflakeConfig, address: str, message: str) -> None:
    with pytest.raises(InvalidLayout, match=message):
        check_leaf_sharing(config, address)


def test_other_roots_and_modes_are_not_leafs_business() -> None:
    check_leaf_sharing(SnowflakeConfig(mode="zookeeper"), "web-1:3fa2c0de")  # the dispenser's own root
    check_leaf_sharing(leaf_shared(mode="static"), "web-1:3fa2c0de")
