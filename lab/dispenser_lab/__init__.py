"""The dispenser's lab: what its tests, benchmarks and experiments run, kept out of the product.

A distribution of its own (``leaf-dispenser-lab``, ``lab/pyproject.toml``) that imports ``dispenser`` and is
never imported by it (an import contract in ``pyproject.toml`` holds that):

* :mod:`dispenser_lab.servers`: real NATS, PostgreSQL (plain and under Patroni), ZooKeeper, Kafka and
  MariaDB processes on 127.0.0.1 with free ports, for tests and ``dispenser dev``;
* :mod:`dispenser_lab.faultproxy`: a TCP proxy that adds latency, cuts and black holes;
* :mod:`dispenser_lab.bench`: the benchmarks (``dispenser bench``);
* :mod:`dispenser_lab.devstack` and :mod:`dispenser_lab.devstack_ha`: the development stacks
  (``dispenser dev``);
* :mod:`dispenser_lab.soak`: the fault-schedule soak (``scripts/soak``).

``dispenser bench`` and ``dispenser dev`` are the product's commands; the product finds their
implementations here through the ``dispenser.lab`` entry points (:mod:`dispenser_lab.commands`).
"""

__all__: list[str] = []
