"""The key-value protocol between the controller, the supervisors and the training processes.

One TCPStore, hosted by the controller process (never by a training rank, so it survives any
rank's death), carries everything the members of a run say to each other outside Gloo:

=====================  ==============================================================
``ev/n``, ``ev/{i}``   an append-only log of reports to the controller (JSON objects)
``plan/{g}``           the membership of generation ``g`` (JSON), written once
``latest``             the newest published generation
``arrive/{g}``         how many members of generation ``g`` reached its start line
``loop/{slot}/{inc}``  where that incarnation's loop is: ``{g} in`` from generation
                       ``g``'s start line on, ``{g} out`` once it left it (before tearing
                       its groups down)
``arrived/{g}``        set by the last member to arrive, or by the controller when it
                       publishes ``g + 1`` (so nobody waits at a superseded start line)
``resume/{g}``         the step generation ``g`` resumed from (set after its sync)
``committed``          set by the first commit of each process: from then on a fresh
                       process's seeded init is no longer the state of step 0
``hb/{slot}/{inc}``    heartbeat counter of one incarnation of one slot; negative once
                       the controller fenced it from another node (``controller.FENCED``)
``snapshots``          ``host:port`` of the controller's snapshot server
                       (``aftershock.reference_impl._snapshots``: the snapshots themselves go there)
``job/end``            set by the controller when training is over; it also writes
                       ``plan/{g+1}`` as ``{"end": true}`` then, which wakes every
                       process blocked waiting for a next plan
``exited``             processes that saw ``job/end`` and left
=====================  ==============================================================

A *slot* is a torchrun worker (its ``RANK``); an *incarnation* is one process that ran in the
slot (a killed worker is re-forked by its supervisor). A logical training rank is assigned to
a (slot, incarnation) by a plan.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# Connecting is generous (start-up on a busy host); single operations are local and fast.
CONNECT_TIMEOUT = timedelta(seconds=120)
# For connections that block in ``wait`` until a key appears (a spare waiting for a plan may
# wait all run long). A ``wait`` that times out leaves the connection unusable (the server
# still answers the abandoned wait later), so such a connection never times out; if the
# server goes away, the socket closes and the wait raises at once.
WAIT_FOREVER = timedelta(days=365)


def connect(
    host: str, port: int, *, host_it: bool = False, timeout: timedelta = CONNECT_TIMEOUT
) -> dist.Store:
    """This run's view of the store: keys are prefixed by torchrun's restart count, so a
    relaunched group never reads what the previous one left (the agent's store outlives it)."""
    store = dist.TCPStore(
        host, port, is_master=host_it, wait_for_workers=False, timeout=timeout
    )
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"aftershock/{restart}/", store)


def waiter(host: str, port: int, *, timeout: timedelta = CONNECT_TIMEOUT) -> dist.Store:
    """A connection of its own for blocking ``wait`` calls (see WAIT_FOREVER).

    Blocking on a key instead of polling it matters on a small host: a spare polling every
    2 ms made about a thousand store round trips a second, each one a wake-up of the
    controller's store thread, on the cores the training ranks need."""
    store = connect(host, port, timeout=timeout)
    store.set_timeout(WAIT_FOREVER)
    return store


#: What the controller writes into a report index whose writer never filled it.
HOLE = json.dumps({"type": "hole"})


def report(store: dist.Store, **fields: Any) -> None:
    """Append one report to the controller's log: take the next index, then write it.

    A reporter killed between the two leaves a hole, which the controller fills once later
    indexes are taken (``controller.HOLE_S``); one that was only slow finds its index
    filled, and takes another."""
    value = json.dumps(fields)
    while not claim(store, store.add("ev/n", 1) - 1, value):
        pass


def claim(store: dist.Store, index: int, value: str) -> bool:
    """Write report ``value`` at ``index``, unless the controller filled it as a hole:
    written only if the key does not exist yet (TCPStore's compare_set with "")."""
    return bool(store.compare_set(f"ev/{index}", "", value) == value.encode())


def get_json(store: dist.Store, key: str) -> Any:
    return json.loads(store.get(key))


def has(store: dist.Store, key: str) -> bool:
    return bool(store.check([key]))


def latest(store: dist.Store) -> int:
    return int(store.get("latest")) if has(store, "latest") else -1
