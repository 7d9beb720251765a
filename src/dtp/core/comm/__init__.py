"""The one recorded path for collectives.

Every collective dtp issues goes through this package, which runs it on the process
group of one named mesh axis and appends a :class:`CommRecord` to every active
:func:`comm_log`. Tests assert communication volume and overlap from those records;
``train_step`` reports bytes per collective per mesh axis from them.

One module per job; each imports only from those above it:

===============  =====================================================================
``records``      :class:`CommRecord`, :class:`CommLog`, :func:`comm_log`, :func:`span`;
                 which logs a thread records into (:func:`active_logs`,
                 :func:`record_into`)
``board``        when each rank posted each transfer, shared between the processes of
                 one machine (the link model's start times)
``link``         :func:`simulated_link`: a slow link modelled per mesh axis
``flight``       the always-on flight recorder (:func:`flight_record`), its file
                 mirror (:data:`FLIGHT_DIR_ENV`), :class:`CollectiveError`
``handles``      :class:`CommHandle` (an ``async_op=True`` collective), :func:`drain`
``collectives``  the collectives (incl. :func:`all_to_all_v`,
                 :func:`exchange_counts`, :func:`barrier`) and the bytes each records
                 (:func:`ring_bytes`)
``p2p``          point to point: :class:`Peer` (one coordinate, its group resolved
                 once), :func:`send` / :func:`recv`
===============  =====================================================================

>>> with dtp.testing.simulate(2):
...     mesh = make_mesh(dp=2)
...     with comm_log() as log:
...         y = all_reduce(torch.ones(1000), mesh, "dp")
>>> log.summary()
{'dp': {'all_reduce': 4000}}
"""

from __future__ import annotations

import sys

from .collectives import (all_gather, all_reduce, all_to_all, all_to_all_v, any_rank, barrier, exchange_counts,
                          reduce_scatter, ring_bytes, send_recv, send_recv_batch)
from .flight import FLIGHT_DIR_ENV, FLIGHT_SLOTS, CollectiveError, FlightEntry, flight_record, format_flight_record
from .handles import CommHandle, drain
from .link import simulated_link
from .p2p import Peer, recv, send
from .records import CommLog, CommRecord, Span, active_logs, comm_log, record_into, span


__all__ = [
    "CommRecord",
    "CommLog",
    "ring_bytes",
    "CommHandle",
    "comm_log",
    "active_logs",
    "record_into",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "all_to_all_v",
    "exchange_counts",
    "send_recv",
    "send_recv_batch",
    "send",
    "recv",
    "Peer",
    "barrier",
    "any_rank",
    "drain",
    "Span",
    "span",
    "simulated_link",
    "CollectiveError",
    "FlightEntry",
    "flight_record",
    "format_flight_record",
    "FLIGHT_SLOTS",
    "FLIGHT_DIR_ENV",
]

# CollectiveError is named dtp.comm.CollectiveError (the line a failed rank prints, flight.py):
# that module name is this package, also before anyone imports it by its old name, so a
# pickled CollectiveError travels by reference and is the same class in another process.
sys.modules.setdefault("dtp.comm", sys.modules[__name__])
