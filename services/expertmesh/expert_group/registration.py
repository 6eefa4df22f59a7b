"""A group's address in the shared state store, kept there, for its own checkpoint's deployment only.

Registering once at start is not enough: a flushed or replaced store (a Redis
restart without persistence, say) would leave every router without the group's
address until the group restarted. So the group writes its endpoint again every
``interval_s``; the write is idempotent, and a store that cannot be reached is
retried at the next round.

A group started from another checkpoint than the deployment's (a rolling upgrade
into the same ``--deployment``, a wrong volume) must not register under its name:
that would replace the good group's address, and its partial sums, of the right
shapes, would change answers. So before each write the group compares its
checkpoint's ``ModelIdentity`` with the model the stored routing table names
(``foreign_model``): at start a difference is ``ForeignCheckpoint`` (the group
does not start, and says why), later it is logged and the write skipped. A store
without a table (yet) cannot say; routers and the orchestrator check every group
they call.
"""

from __future__ import annotations

import logging
import threading

from expertmesh.contracts.errors import ForeignCheckpoint
from expertmesh.contracts.routing_table import MalformedTable, ModelIdentity, RoutingTable
from expertmesh.store import StateStore

log = logging.getLogger(__name__)

INTERVAL_S = 5.0


def foreign_model(group: str, model: ModelIdentity | None, table: RoutingTable | None) -> str | None:
    """Why ``group``, holding ``model``, must not register beside ``table`` (the stored routing table), or
    None when it may (no table, or a table or group of no known model: nothing to compare)."""
    if model is None or table is None or table.model is None:
        return None
    differences = table.model.differences(model)
    if not differences:
        return None
    return (
        f"expert group {group} holds another model than this deployment's routing table is for "
        f"({'; '.join(differences)}): it does not register, so no router sends it tokens; start it from the "
        "deployment's checkpoint, or under a deployment of its own (--deployment, EXPERTMESH_DEPLOYMENT)"
    )


class EndpointRegistration:
    def __init__(
        self,
        store: StateStore,
        group: str,
        address: str,
        interval_s: float = INTERVAL_S,
        model: ModelIdentity | None = None,
    ):
        """``model``: the group's checkpoint's identity; it registers only beside a routing table of that model
        (None: anywhere)."""
        self._store = store
        self._group = group
        self._address = address
        self._interval = interval_s
        self._model = model
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"expertmesh-register-{group}", daemon=True)
        #: (routing-table version, the refusal beside it or None): the table is read again only when its version
        #: changes (a large model's table is large; its version is one GET)
        self._verdict: tuple[int, str | None] | None = None

    def start(self) -> "EndpointRegistration":
        """Register now (an unreachable store fails here, at start; a deployment of another checkpoint is
        ForeignCheckpoint) and keep doing so."""
        refusal = self._refusal()
        if refusal is not None:
            raise ForeignCheckpoint(refusal)
        self._store.set_endpoint(self._group, self._address)
        self._thread.start()
        return self

    def _refusal(self) -> str | None:
        """``foreign_model`` beside the stored table, read again only when its version changed."""
        if self._model is None:
            return None
        version = self._store.routing_table_version()
        if self._verdict is None or self._verdict[0] != version:
            try:
                table = self._store.routing_table()
            except MalformedTable:  # nothing to compare with: routers refuse such a table themselves
                table = None
            self._verdict = (version, foreign_model(self._group, self._model, table))
        return self._verdict[1]

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._register()
            except ConnectionError as err:
                log.warning("could not re-register expert group %s: %s", self._group, err)

    def _register(self) -> None:
        known = self._verdict
        refusal = self._refusal()
        if refusal is not None:
            if known is None or known[1] != refusal:  # once per problem, not every round
                log.error("%s", refusal)
            return
        self._store.set_endpoint(self._group, self._address)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._store.close()
