"""``scripts/soak``: a fault-schedule soak test of three worker processes against real servers.

Real NATS, PostgreSQL and ZooKeeper servers (:mod:`dispenser_lab.servers`) and three ``dispenser serve``
processes run on 127.0.0.1 while a few asyncio clients ask for millions of segment and snowflake IDs in
batches, and a schedule injects faults: a worker killed with SIGKILL and restarted, PostgreSQL and
ZooKeeper stopped and started, the NATS server restarted, a snowflake worker's clock stepped with
libfaketime. Every reply is checked and every ID kept (as ranges), so that the end of the run can say
whether any ID was handed out twice. See ``docs/soak.md``.

Modules: :mod:`~soak.plan` (profiles and their phases, pure), :mod:`~soak.ledger`
(reply checks and the ID ranges, pure), :mod:`~soak.faketime` (libfaketime),
:mod:`~soak.cluster` (servers and workers), :mod:`~soak.load` (the clients and the
per-phase figures), :mod:`~soak.report` (verdict, table, JSON), :mod:`~soak.run`
(the command).
"""
