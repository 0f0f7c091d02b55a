"""Wiring: a worker built from a :class:`~dispenser.config.Config` part by part, and the commands that run it.

One module per part, each started into the worker's exit stack and returning its object: the segment side
(:mod:`~dispenser.app.segments`: PostgreSQL, the allocator, the replay store, the residue claims),
:mod:`~dispenser.app.snowflake`, :mod:`~dispenser.app.rates`, serving over :mod:`~dispenser.app.nats`,
:mod:`~dispenser.app.kafka` and :mod:`~dispenser.app.http`, and :mod:`~dispenser.app.operations` (``/metrics``,
the probes). :mod:`~dispenser.app.worker` starts them in order; :mod:`~dispenser.app.commands` runs a worker
until a signal (:mod:`~dispenser.app.stopping`: the signals, the stop budget, the background tasks).
"""

from dispenser.app.commands import run_enricher, run_worker
from dispenser.app.parts import Off, PartOff
from dispenser.app.segments import grants_dir, open_grants
from dispenser.app.stopping import Run, background, run_until_signal
from dispenser.app.worker import NotStarted, Parts, Worker

__all__ = [
    "NotStarted",
    "Off",
    "PartOff",
    "Parts",
    "Run",
    "Worker",
    "background",
    "grants_dir",
    "open_grants",
    "run_enricher",
    "run_until_signal",
    "run_worker",
]
