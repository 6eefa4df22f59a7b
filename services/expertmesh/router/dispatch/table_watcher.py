"""The router's table watcher: the routing view its steps dispatch on, kept current from the state store —
the routing table, the group endpoints and the quarantined replicas — and reported by the heartbeat.

Started (``start``), a thread of its own asks the store every ``poll_s`` whether the table version changed
(one GET) and which replicas are quarantined (one HGETALL), and builds a new ``RoutingView`` when either
did, so no serving step ever waits on the store. A store that does not answer (refused, or frozen until
the client's socket timeout) costs this thread its wait, never a step: it backs off, doubling its interval
up to ``max_backoff_s``, and steps serve on the last good view. Not started (tests, ``verify``), the store
is read at each step boundary instead (``begin_step``).

A view built while a serving step runs (``step``) is swapped in at the next step boundary: every layer of a
step dispatches on one table version, and no newer version is reported (the heartbeat) before the step
ends — a migration unloads an old replica only once every router reports a version without it. A store
that cannot be reached, a flushed one, or a table that must not be served (``RoutingTableRefused``: experts
left unhosted, made for another model, unreadable) keeps the last good view in use.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Iterator, Sequence

from expertmesh.contracts.errors import ExpertMeshError, GroupUnavailable, RoutingTableRefused
from expertmesh.contracts.routing_table import MalformedTable, ModelIdentity, RoutingTable
from expertmesh.router.dispatch.heartbeat import Heartbeat
from expertmesh.router.dispatch.routing_view import RoutingView
from expertmesh.router.policy.gate_hook import GateBias, masked
from expertmesh.router.transport.base import Transport
from expertmesh.store import StateStore

log = logging.getLogger(__name__)

#: the longest the watcher spends setting up the way to one group a new table brings (``Transport.prepare``)
PREPARE_TIMEOUT_S = 2.0


class TableWatcher:
    def __init__(
        self,
        store: StateStore,
        moe_layers: Sequence[int],
        transport: Transport,
        *,
        model: ModelIdentity | None = None,
        gate_bias: GateBias | None = None,
        fallback: str = "next_best",
        heartbeat: Heartbeat | None = None,
        poll_s: float = 0.25,
        max_backoff_s: float = 5.0,
    ):
        """``transport``: told the groups' addresses with each new view. ``model``: the router's model; tables
        made for another are refused (None: checked against ``moe_layers`` and the table's own expert count
        only). ``gate_bias``: stops the gates choosing an expert whose every replica is quarantined (with the
        ``next_best`` fallback). ``heartbeat``: told each version switched to."""
        self._store = store
        self._moe_layers = tuple(moe_layers)
        self._transport = transport
        self._model = model
        self._gate_bias = gate_bias
        self._fallback = fallback
        self._heartbeat = heartbeat
        self._poll_s = poll_s
        self._max_backoff_s = max(max_backoff_s, poll_s)
        self._refresh_lock = threading.Lock()  # one refresh at a time (held over store reads)
        #: guards ``view``, ``_pending`` and ``_steps_in_flight``; never held over I/O: a step never waits on the store
        self._view_lock = threading.Lock()
        self.view: RoutingView | None = None
        #: a view built while a serving step ran: swapped in at the next step boundary (``begin_step``)
        self._pending: RoutingView | None = None
        self._steps_in_flight = 0
        self._rejected_version = 0
        self._store_errors = 0
        self._quarantined: frozenset[tuple[int, int, str]] = frozenset()
        #: the routing epoch (``routing_view``): moved on with every change of ``_quarantined``
        self._epoch = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: rounds in a row the store did not answer, and what it said the latest time (None: it answers)
        self.failures = 0
        self.store_problem: str | None = None
        self._last_problem: str | None = None

    @property
    def table(self) -> RoutingTable | None:
        view = self.view
        return view.table if view is not None else None

    @property
    def version(self) -> int | None:
        """The routing-table version served now (None: none yet)."""
        view = self.view
        return view.version if view is not None else None

    @property
    def epoch(self) -> int:
        """The newest routing epoch this router knows of (its views carry the one they were built in)."""
        return self._epoch

    def endpoints(self) -> dict[str, str]:
        """The group endpoints the store lists now (a dispatcher's fresh addresses of a group that went away)."""
        return self._store.endpoints()

    def addresses(self) -> dict[str, str]:
        """The address this router dials for each group of its view (no store I/O: the transport's)."""
        view = self.view
        return {g: a for g in (view.groups if view is not None else ()) if (a := self._transport.address(g))}

    @property
    def watched(self) -> bool:
        """Whether the thread keeps the view current (else each step boundary reads the store)."""
        return self._thread is not None and not self._stop.is_set()

    # -- steps -------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """At a step boundary: make sure there is a view to serve. Watched, the step does no store I/O (it
        swaps in a view built during the last step); unwatched, the store is read now (``refresh``)."""
        if not self.watched or self.view is None:
            self.refresh()
            return
        with self._view_lock:
            pending, self._pending = self._pending, None
            if pending is not None:
                self._swap(pending)
        if pending is not None:
            self._switched(pending)

    @contextmanager
    def step(self) -> Iterator[RoutingView | None]:
        """One serving step: the view every layer of it dispatches on. No view built meanwhile is swapped in
        (or reported) before the step ends."""
        with self._view_lock:
            self._steps_in_flight += 1
            view = self.view
        try:
            yield view
        finally:
            with self._view_lock:
                self._steps_in_flight -= 1

    # -- the routing view ----------------------------------------------------------------

    def refresh(self) -> None:
        """Switch to the newest routing table, if it changed and may be served. Cheap when it did not.

        With a view in use, an unreachable store, a flushed one (version 0: the orchestrator and the groups
        publish again) or a refused table is logged and the last good view stays; without one, they raise
        (ConnectionError / GroupUnavailable / RoutingTableRefused).
        """
        with self._refresh_lock:
            current = self._pending or self.view  # the newest view this router has built
            try:
                version = self._store.routing_table_version()
                if current is not None and version in (0, current.version, self._rejected_version):
                    self._store_errors = 0
                    self.store_problem = None
                    if version == 0:  # flushed: whatever is published next is a new table, even at a refused version
                        self._rejected_version = 0
                    return
                table = self._store.routing_table()
                endpoints = self._store.endpoints()
            except ConnectionError as err:
                self.store_problem = str(err) or type(err).__name__
                if current is None:
                    raise
                self._store_errors += 1
                if self._store_errors == 1:  # once per outage, not once per step
                    log.warning(
                        "state store unreachable; serving on routing table version %d: %s", current.version, err
                    )
                return
            except MalformedTable as err:
                return self._refuse(version, current, RoutingTableRefused(f"routing table version {version}: {err}"))
            self._store_errors = 0
            self.store_problem = None
            if table is None:
                if current is not None:  # the version key outlived the table (a store being flushed): serve on
                    return
                raise GroupUnavailable("no routing table in the state store; start the expert groups first")
            if current is not None and table.version < current.version:
                log.warning(
                    "routing table version went back from %d to %d: the state store was reset",
                    current.version,
                    table.version,
                )
            try:
                view = RoutingView.build(table, self._moe_layers, self._quarantined, self._model, self._epoch)
            except RoutingTableRefused as err:
                return self._refuse(table.version, current, err)
            self._rejected_version = 0
            # A group not (yet again) listed in the store keeps the address we know: a flushed store heals
            # as groups re-register, and its calls go on meanwhile.
            known = {g: self._transport.address(g) for g in view.groups}
            self._transport.update({g: a for g in view.groups if (a := endpoints.get(g) or known[g])})
            # A group this table brings (one added live, a replica started): asked how to reach it and dialled
            # here, before the table is served, so its first call on a step does not pay for that.
            for group in sorted(set(view.groups) - set(current.groups if current is not None else ())):
                self._transport.prepare(group, PREPARE_TIMEOUT_S)
            swapped = self._use(view)
        if swapped:
            self._switched(view)

    def refresh_quarantine(self) -> None:
        """Take the health monitor's quarantined replicas into the view when they changed (every round: a
        quarantine need not wait for a new table version).

        A store without a table (flushed) keeps the last quarantines: the flush took the entries too, and the
        orchestrator puts them back before it publishes a table. So the entries count only when a table version
        is there before and after reading them (a flush in between reads as a change of version)."""
        version = self._store.routing_table_version()
        quarantined = frozenset(self._store.quarantined())
        if version == 0 or self._store.routing_table_version() != version:
            return
        with self._refresh_lock:
            if quarantined == self._quarantined:
                return
            self._quarantined = quarantined
            self._epoch += 1  # before any view of the new set exists: a step on it never runs in the old epoch
            base = self._pending or self.view  # the newest table this router has, whether or not it serves it yet
            if base is None:
                return
            view = RoutingView.build(base.table, self._moe_layers, quarantined, self._model, self._epoch)
            self._use(view)
        log.warning(
            "quarantined replicas now %s; experts served by the %s fallback: %s",
            sorted(quarantined) or "none",
            self._fallback,
            {layer: sorted(e) for layer, e in view.fallback.items()} or "none",
        )

    def _switched(self, view: RoutingView) -> None:
        log.info("routing table version %d: %d groups", view.version, len(view.groups))
        if self._heartbeat is not None:
            self._heartbeat.beat(view.version)

    def _refuse(self, version: int, current: RoutingView | None, err: RoutingTableRefused) -> None:
        """Table ``version`` must not be served: raise without a view, else keep serving ``current``."""
        self._rejected_version = version
        if current is None:
            raise err
        log.error("refused %s; still serving version %d", err, current.version)

    def _use(self, view: RoutingView) -> bool:
        """Swap ``view`` in now, or, while a serving step runs, at the next step boundary. True: swapped now."""
        with self._view_lock:
            if self._steps_in_flight:
                self._pending = view
                return False
            self._pending = None
            self._swap(view)
            return True

    def _swap(self, view: RoutingView) -> None:
        """(Under ``_view_lock``) ``view`` in use; the gates stop choosing its fallback experts (next-best fallback)."""
        if self._gate_bias is not None and self._fallback == "next_best":
            self._gate_bias.set({layer: masked(view.num_experts, experts) for layer, experts in view.fallback.items()})
        self.view = view

    # -- the thread ----------------------------------------------------------------------

    def start(self) -> "TableWatcher":
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="expertmesh-table-watcher", daemon=True)
        self._thread.start()
        return self

    def poll_once(self) -> bool:
        """One round; True when the store answered."""
        try:
            self.refresh_quarantine()
            self.refresh()
        except ConnectionError as err:
            self.failures += 1
            self.store_problem = str(err) or type(err).__name__
            if self.failures == 1:
                log.warning("state store not answering; steps serve on the routing table they have: %s", err)
            return False
        except Exception as err:  # the store answered, but: a refused table without a view to keep, or a bug
            if str(err) != self._last_problem:  # once per problem, not four times a second
                log.warning("routing-table watch round failed: %s", err, exc_info=not isinstance(err, ExpertMeshError))
                self._last_problem = str(err)
        else:
            self._last_problem = None
        if self.failures:
            log.info("state store answering again after %d failed rounds", self.failures)
        self.failures = 0
        self.store_problem = None
        return True

    def next_wait(self) -> float:
        """Seconds until the next round: ``poll_s``, doubled per failed round up to ``max_backoff_s``."""
        return min(self._poll_s * 2 ** min(self.failures, 30), self._max_backoff_s) if self.failures else self._poll_s

    def _run(self) -> None:
        while not self._stop.wait(self.next_wait()):
            self.poll_once()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._thread = None
