"""The nodes of an elastic job meet through torch's c10d rendezvous, under a backend of runner's own
(`ELASTIC_BACKEND`, registered with torch's public handler registry) that puts right what torch's handler
(2.9-2.13) gets wrong when the nodes change between rounds:

- A node that joins a running job waits forever for where its ranks meet (`RendezvousStoreInfo`): the
  group's first node publishes it only in its own first round. Here it publishes it in every round, and
  every node reads it again (the first node may be another one now, a lost node's survivor).
- A round that only takes a node in (no rank failed) keeps `TORCHELASTIC_RESTART_COUNT`, under which the
  ranks' store keys are kept: the new ranks would read the addresses of the old ones. Every round names
  itself (`ROUND_VARIABLE`) and the ranks meet under that name (`cluster.torchelastic`).
- The nodes waiting to join are forgotten as soon as one node enters the next round: a node whose ranks
  stopped with the others (checkpointed, for the change) would take their stop for the job's end. Here a
  node that entered a round since this one's began counts as waiting.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from torch.distributed import Store
from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from runner.cluster.torchelastic import ROUND_VARIABLE

log = logging.getLogger(__name__)

ELASTIC_BACKEND = "runner-c10d"
_ROUND_KEY = "runner/round"  # in each round's store: the round's name
_ENTERED_KEY = "runner/entered"  # in the rendezvous's store: how many times a node entered a round


class ElasticRendezvous(RendezvousHandler):
    """torch's c10d rendezvous handler (`handler`), each round's meeting point published by its first
    node and read by every other, and each round named for its ranks. Every node counts itself in
    `store` (the rendezvous's own) as it enters a round, so that a node that entered since this one's round
    began counts as waiting: torch's wait list empties as soon as one node starts the next round, and the
    others, whose ranks stopped with it, would take their stop for the job's end."""

    def __init__(self, handler: RendezvousHandler, store: Store) -> None:
        self.handler, self.store = handler, store
        self.entered = 0  # the entries counted once this node's last round began

    def next_rendezvous(self) -> RendezvousInfo:
        self.store.add(_ENTERED_KEY, 1)
        info = self.handler.next_rendezvous()
        self.entered = self.store.add(_ENTERED_KEY, 0)
        store, meeting = info.store, info.bootstrap_store_info
        if info.rank == 0:
            assert meeting is not None  # torch builds it on the first node of every round
            store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, meeting.master_addr)
            store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(meeting.master_port))
            store.set(_ROUND_KEY, uuid.uuid4().hex)
        else:
            meeting = RendezvousStoreInfo(
                store.get(RendezvousStoreInfo.MASTER_ADDR_KEY).decode(),
                int(store.get(RendezvousStoreInfo.MASTER_PORT_KEY).decode()),
            )
        os.environ[ROUND_VARIABLE] = store.get(_ROUND_KEY).decode()  # the ranks inherit it
        if info.rank == 0:
            log.info("the job's nodes met: %d node(s)", info.world_size)
        return RendezvousInfo(store, info.rank, info.world_size, meeting)

    def get_backend(self) -> str:
        return ELASTIC_BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self.handler.use_agent_store

    def is_closed(self) -> bool:
        return self.handler.is_closed()

    def set_closed(self) -> None:
        self.handler.set_closed()

    def num_nodes_waiting(self) -> int:
        if waiting := self.handler.num_nodes_waiting():
            return waiting
        return 1 if self.store.add(_ENTERED_KEY, 0) > self.entered else 0  # one already in the next round

    def get_run_id(self) -> str:
        return self.handler.get_run_id()

    def shutdown(self) -> bool:
        return self.handler.shutdown()


def _create(params: RendezvousParameters) -> RendezvousHandler:
    backend, store = create_backend(params)
    return ElasticRendezvous(create_handler(store, backend, params), store)


def elastic_nodes(
    min_nodes: int, max_nodes: int, endpoint: str, hosts: bool, run_id: str, wait_s: float
) -> dict[str, Any]:
    """The `LaunchConfig` options of one node of an elastic job of `min_nodes` to `max_nodes` nodes,
    meeting at `endpoint` (host:port; `hosts`: this node serves it), where a round that has its
    `min_nodes` waits `wait_s` for more; a node silent for 6 s is lost."""
    rendezvous_handler_registry.register(ELASTIC_BACKEND, _create)  # again: the same creator is taken
    return {
        "min_nodes": min_nodes,
        "max_nodes": max_nodes,
        "rdzv_backend": ELASTIC_BACKEND,
        "rdzv_endpoint": endpoint,
        "run_id": run_id,
        "rdzv_configs": {
            "is_host": hosts,
            "last_call_timeout": max(1, round(wait_s)),
            "keep_alive_interval": 2,
            "keep_alive_max_attempt": 3,
            "join_timeout": 900,
        },
    }
