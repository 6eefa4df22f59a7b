"""The faults, one at a time: each ``run`` injects its fault into the running platform, keeps
it in place for ``hold_s`` (or watches what it sets off), lifts it where lifting is ours to do,
waits until the platform is whole again and returns what it saw as a ``measure.Timeline``.
A fault that is not lifted in time still leaves the platform as it found it where it can
(a stopped group is always continued)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from expertmesh.bench.chaos.measure import Timeline
from expertmesh.bench.chaos.platform import ChaosPlatform, wait_until
from expertmesh.bench.report import BenchError
from expertmesh.contracts.errors import ExpertMeshError
from expertmesh.orchestrator.health import state as health_state
from expertmesh.orchestrator.health.state import HealthState, Initiator, ReplicaId
from expertmesh.v1 import admin_pb2 as admin_pb
from expertmesh.v1 import experts_pb2 as pb

#: how long a fault may take to heal before the scenario is reported as not recovered
RECOVERY_TIMEOUT_S = 180.0


class Fault(Protocol):
    name: str
    #: one line for the report
    description: str

    def run(self, platform: ChaosPlatform, hold_s: float) -> Timeline: ...


def _hold_until(start: float, hold_s: float) -> None:
    time.sleep(max(0.0, start + hold_s - time.monotonic()))


def held(inject: Callable[[], object], lift: Callable[[], object], hold_s: float) -> tuple[float, float]:
    """``inject`` a fault, keep it ``hold_s``, ``lift`` it (also when the hold is cut short):
    (injected, lifted), time.monotonic() just before the one and just after the other."""
    injected = time.monotonic()
    inject()
    try:
        time.sleep(hold_s)
    finally:
        lift()
    return injected, time.monotonic()


def lifted_until_the_router_reports(platform: ChaosPlatform) -> tuple[float, float | None]:
    """(now, when the router has reported to the store since now): a store fault lifted, and healed."""
    lifted, wall = time.monotonic(), time.time()
    recovered = wait_until(
        lambda: any(b.at > wall for b in platform.store.router_heartbeats().values()), RECOVERY_TIMEOUT_S
    )
    return lifted, recovered


def replicas_hold_their_experts(platform: ChaosPlatform, table) -> bool:
    """Every group ``table`` lists for a (layer, expert) holds it (``Describe``)."""
    holds = {g: platform.describe(g).pairs for g in table.groups()}
    return all(pair in holds[g] for pair, groups in table.replicas.items() for g in groups)


@dataclass(frozen=True)
class GroupKilled:
    """SIGKILL of a group's replica process: Ray Serve starts a new one, which loads its experts,
    listens on the same port and registers again; meanwhile routers fail over to the experts'
    other replicas."""

    group: str
    name: str = "group-sigkill"

    @property
    def description(self) -> str:
        return f"SIGKILL of expert group {self.group}'s replica (Ray Serve restarts it)"

    def run(self, platform: ChaosPlatform, hold_s: float) -> Timeline:
        pid = platform.describe(self.group).pid
        injected = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        recovered = wait_until(lambda: platform.describe(self.group).pid != pid, RECOVERY_TIMEOUT_S)
        _hold_until(injected, hold_s)
        return Timeline(injected, injected, recovered)


@dataclass(frozen=True)
class GroupStopped:
    """SIGSTOP of a group's replica for ``hold_s``, then SIGCONT: a hung group, which accepts
    connections and never answers. The router hedges its calls onto the experts' other replicas
    once they are slower than the hedge delay, and its circuit breaker then keeps it out of the
    plan (one trial call per cooldown, hedged the same way) while the other replicas serve."""

    group: str
    name: str = "group-sigstop"

    @property
    def description(self) -> str:
        return f"SIGSTOP of expert group {self.group}'s replica for the hold, then SIGCONT"

    def run(self, platform: ChaosPlatform, hold_s: float) -> Timeline:
        pid = platform.describe(self.group).pid
        injected, lifted = held(lambda: os.kill(pid, signal.SIGSTOP), lambda: os.kill(pid, signal.SIGCONT), hold_s)
        return Timeline(injected, lifted, wait_until(lambda: platform.group_answers(self.group), RECOVERY_TIMEOUT_S))


@dataclass(frozen=True)
class ExpertCorrupted:
    """One replica's weights scaled in place by ``factor`` (``InjectFault``): it keeps answering,
    finite and plausible, and wrong. The health monitor finds it (its weight fingerprint no
    longer matches) and quarantines it: with another replica, the table stops listing it (no
    quality change); as the expert's only replica (``evict``: the other one is evicted first by
    a live migration, and replicated back at the end) it stays listed and routers fall back
    around the expert (degraded). Either way the monitor repairs it from the checkpoint at its
    next round, and after its probation it serves again."""

    layer: int
    expert: int
    group: str
    #: share of the tokens that chose this expert in the load so far
    share: float
    factor: float = 2.0
    #: the expert's other replica, evicted for the fault (the degraded case); None: keep it
    evict: str | None = None

    @property
    def name(self) -> str:
        return "expert-corrupted" if self.evict is None else "expert-corrupted-sole"

    @property
    def description(self) -> str:
        other = (
            "its other replica is healthy"
            if self.evict is None
            else f"its other replica (on {self.evict}) evicted first"
        )
        return (
            f"weights of layer {self.layer} expert {self.expert} (chosen by {self.share:.1%} of tokens) scaled by "
            f"{self.factor:g} in place on group {self.group}; {other}"
        )

    def run(self, platform: ChaosPlatform, hold_s: float) -> Timeline:
        pair = (self.layer, self.expert)
        if self.evict is not None:
            platform.migrate(self.layer, self.expert, admin_pb.MIGRATION_MODE_EVICT, source=self.evict)
        watch = _ReplicaWatch(platform, ReplicaId(self.layer, self.expert, self.group), sole=self.evict is not None)
        injected = time.monotonic()
        platform.channels.inject_fault(self.group, pair, pb.FAULT_KIND_SCALE, self.factor)
        recovered = wait_until(watch.whole_again, RECOVERY_TIMEOUT_S, poll_s=0.05)
        _hold_until(injected, hold_s)
        if self.evict is not None:
            platform.migrate(
                self.layer, self.expert, admin_pb.MIGRATION_MODE_REPLICATE, target=self.evict, source=self.group
            )
            if recovered is not None:
                recovered = time.monotonic()  # whole again: both replicas again
        seen = watch.seen
        return Timeline(
            injected,
            injected,
            recovered,
            detected=seen.get("detected"),
            quarantined=seen.get("quarantined"),
            fallback_until=seen.get("fallback_until"),
            repaired=seen.get("repaired"),
            note="" if "detected" in seen else "the health monitor never found it",
        )


class _ReplicaWatch:
    """Polled: when one replica's health record, the routing table, the quarantine entries and
    the router's reports show it found, out of service, repaired and serving again.

    Out of service, for the router: with another replica, once its heartbeat reports a table
    version that no longer lists it (it switches tables at step boundaries, then reports); as
    the only replica, once two heartbeats followed the quarantine entry (each heartbeat round
    re-reads the entries and then beats; the first one after may have read them just before).
    The fallback ends likewise, two heartbeats after the entry went."""

    def __init__(self, platform: ChaosPlatform, replica: ReplicaId, sole: bool):
        self._platform = platform
        self._replica = replica
        self._sole = sole
        #: what happened, when (time.monotonic())
        self.seen: dict[str, float] = {}
        self._withdrawn_in = 0  # the table version that stopped listing it
        #: time.time() when the quarantine entry appeared / went, and the heartbeats since
        self._entry_changed: dict[str, float] = {}
        self._beats: dict[str, set[float]] = {}

    def _two_beats_after(self, change: str, beat: float) -> bool:
        if change not in self._entry_changed:
            return False
        if beat > self._entry_changed[change]:
            self._beats.setdefault(change, set()).add(beat)
        return len(self._beats.get(change, ())) >= 2

    def whole_again(self) -> bool:
        """Note what shows now; True once it is healthy and served as before the fault."""
        store, rid, now = self._platform.store, self._replica, time.monotonic()
        record = health_state.load_all(store).get(rid)
        table = store.routing_table()
        listed = rid.group in table.replicas.get(rid.pair, ())
        entry = (rid.layer, rid.expert, rid.group) in store.quarantined()
        beats = store.router_heartbeats().values()
        served = max((b.table_version for b in beats), default=0)
        beat = max((b.at for b in beats), default=0.0)
        if (record is not None and record.state is not HealthState.HEALTHY) or entry or not listed:
            self.seen.setdefault("detected", now)
        if record is not None and record.state is HealthState.PROBATION:
            self.seen.setdefault("repaired", now)
        if not listed and not self._withdrawn_in:
            self._withdrawn_in = table.version
        if self._withdrawn_in and served >= self._withdrawn_in:
            self.seen.setdefault("quarantined", now)
        if self._sole:
            if entry:
                self._entry_changed.setdefault("appeared", time.time())
            elif "appeared" in self._entry_changed:
                self._entry_changed.setdefault("went", time.time())
            if self._two_beats_after("appeared", beat):
                self.seen.setdefault("quarantined", now)
            if self._two_beats_after("went", beat):
                self.seen.setdefault("fallback_until", now)
            if "fallback_until" not in self.seen:
                return False
        healthy = record is not None and record.state is HealthState.HEALTHY
        return "quarantined" in self.seen and healthy and listed and not entry and served >= table.version


@dataclass(frozen=True)
class RedisStopped:
    """The state store down for ``down_s`` (SHUTDOWN SAVE, then started again with its data):
    routers serve on their cached table, groups and orchestrator retry."""

    down_s: float = 10.0
    name: str = "redis-stopped"

    @property
    def description(self) -> str:
        return f"redis-server shut down for {self.down_s:g} s, then started again with its data"

    def run(self, platform: ChaosPlatform, hold_s: float) -> Timeline:
        injected = time.monotonic()
        platform.redis.stop()
        time.sleep(self.down_s)
        platform.redis.start()
        return Timeline(injected, *lifted_until_the_router_reports(platform))


@dataclass(frozen=True)
class RedisFlushed:
    """FLUSHALL: the table, endpoints, health records and heartbeats gone at once. Routers keep
    their cached table; groups register again; the orchestrator publishes the table again at a
    version after the last one it saw."""

    name: str = "redis-flushed"
    description: str = "FLUSHALL on the state store (table, endpoints, health records: all gone)"

    def run(self, platform: ChaosPlatform, hold_s: float) -> Timeline:
        store = platform.store
        before = store.routing_table_version()
        injected = time.monotonic()
        platform.redis.flush()

        def whole() -> bool:
            return (
                store.routing_table_version() > before
                and set(store.endpoints()) == set(platform.groups)
                and platform.router_version() > before
            )

        recovered = wait_until(whole, RECOVERY_TIMEOUT_S)
        _hold_until(injected, hold_s)
        return Timeline(injected, injected, recovered)


@dataclass(frozen=True)
class OrchestratorKilled:
    """SIGKILL of the orchestrator process for ``hold_s`` (no health rounds, no moves), then
    started again, as its Deployment would: the data plane does not need it to serve."""

    name: str = "orchestrator-killed"
    description: str = "SIGKILL of the orchestrator process; started again after the hold"

    def run(self, platform: ChaosPlatform, hold_s: float) -> Timeline:
        injected = time.monotonic()
        platform.orchestrator.kill()
        time.sleep(hold_s)
        platform.orchestrator.start()
        lifted = time.monotonic()
        try:
            platform.wait_for_orchestrator(RECOVERY_TIMEOUT_S)
        except BenchError as err:
            return Timeline(injected, lifted, None, note=str(err).splitlines()[0])
        return Timeline(injected, lifted, time.monotonic())


@dataclass(frozen=True)
class RedisFrozen:
    """SIGSTOP of redis-server for ``down_s``, then SIGCONT: a store that accepts connections and answers
    nothing (a hung host, a long fork), the case a refused connection does not test. Steps must not wait on
    it: routers keep their table in a watcher thread."""

    down_s: float = 10.0
    name: str = "redis-frozen"

    @property
    def description(self) -> str:
        return f"redis-server frozen (SIGSTOP) for {self.down_s:g} s, then SIGCONT"

    def run(self, platform: ChaosPlatform, hold_s: float) -> Timeline:
        redis = platform.redis.proc
        injected, _ = held(
            lambda: redis.send_signal(signal.SIGSTOP), lambda: redis.send_signal(signal.SIGCONT), self.down_s
        )
        return Timeline(injected, *lifted_until_the_router_reports(platform))


@dataclass(frozen=True)
class TableMismatch:
    """A routing table for another model published over the good one (a misconfigured orchestrator of a
    second deployment writing these keys, say): 2 experts per layer for this model's 4+. Routers refuse it
    and serve on; lifted by publishing the good table again at the next version."""

    name: str = "table-mismatch"
    description: str = (
        "a routing table of another model (fewer experts, another fingerprint) published over the good one"
    )

    def run(self, platform: ChaosPlatform, hold_s: float) -> Timeline:
        from dataclasses import replace

        from expertmesh.contracts.routing_table import ModelIdentity

        store = platform.store
        good = store.routing_table()
        foreign = ModelIdentity("f" * 16, good.model.moe_layers if good.model else (), 2)
        bad = replace(
            good,
            version=good.version + 1,
            num_experts=2,
            replicas={pair: groups for pair, groups in good.replicas.items() if pair[1] < 2},
            shares={},
            model=foreign,
        )
        injected = time.monotonic()
        _write_table(store, bad)
        _hold_until(injected, hold_s)
        fixed = replace(good, version=bad.version + 1)
        _write_table(store, fixed)
        lifted = time.monotonic()
        recovered = wait_until(lambda: platform.router_version() >= fixed.version, RECOVERY_TIMEOUT_S)
        note = "" if platform.router_version() != bad.version else "a router served the foreign table"
        return Timeline(injected, lifted, recovered, note=note)


def _write_table(store, table) -> None:
    """Write ``table`` as the next version whatever model it names, as a foreign writer would (the store's own
    publish refuses another model's table over this one's)."""
    current = store.routing_table_version()
    store._kv.compare_and_set_many(
        store._key("routing_table:version"),
        str(current).encode() if current else None,
        {
            store._key("routing_table"): table.to_json().encode(),
            store._key("routing_table:version"): str(table.version).encode(),
        },
    )


@dataclass(frozen=True)
class FlushedAfterMove:
    """A live move of one expert, then FLUSHALL: the orchestrator must rebuild the table from what the groups
    hold (the moved expert on its new group; the old one unloaded it), at a version above the routers', not
    re-apply the placement file."""

    layer: int
    expert: int
    source: str
    target: str
    name: str = "flush-after-move"

    @property
    def description(self) -> str:
        return f"layer {self.layer} expert {self.expert} moved live {self.source} -> {self.target}, then FLUSHALL"

    def run(self, platform: ChaosPlatform, hold_s: float) -> Timeline:
        store = platform.store
        injected = time.monotonic()
        platform.migrate(self.layer, self.expert, admin_pb.MIGRATION_MODE_MOVE, target=self.target, source=self.source)
        before = max(store.routing_table_version(), platform.router_version())
        platform.redis.flush()

        def whole() -> bool:
            table = store.routing_table()
            if table is None or table.version <= before or platform.router_version() < table.version:
                return False
            return set(store.endpoints()) == set(platform.groups) and replicas_hold_their_experts(platform, table)

        recovered = wait_until(whole, RECOVERY_TIMEOUT_S)
        _hold_until(injected, hold_s)
        return Timeline(injected, injected, recovered)


def foreign_checkpoint(path: Path, out: Path, seed: int = 1) -> Path:
    """A copy of the checkpoint at ``path`` in ``out`` (made once) with every floating-point tensor changed
    (scaled by 1 + 5% noise, seeded): another model of the same shapes, as a fine-tune, an upgrade or a wrong
    volume is. Its checkpoint fingerprint differs; every check of a partial sum's shape, dtype and values
    passes."""
    import torch
    from safetensors.torch import load_file, save_file

    if (out / "config.json").is_file():
        return out
    shutil.copytree(path, out)
    gen = torch.Generator().manual_seed(seed)
    for file in sorted(out.glob("*.safetensors")):
        tensors = load_file(file)
        for key, t in tensors.items():
            if t.is_floating_point():
                noise = 1 + 0.05 * torch.randn(t.shape, generator=gen, dtype=torch.float32)
                tensors[key] = (t.float() * noise).to(t.dtype)
        save_file(tensors, file, metadata={"format": "pt"})
    return out


def _bump_table(store) -> None:
    """The stored routing table again, one version on: routers read the groups' endpoints with it."""
    from dataclasses import replace

    for _ in range(5):
        table = store.routing_table()
        if store.publish_routing_table(replace(table, version=table.version + 1)):
            return
    raise BenchError("the routing table kept changing under the fault; could not publish it again")


@dataclass(frozen=True)
class ForeignCheckpointGroup:
    """A group started from another checkpoint of the same shapes under an existing group's name (a rolling
    upgrade into the same deployment, a wrong volume). First as a replica would start, registering in the
    store: it must refuse to, before it loads anything, and say why. Then one that got in anyway (an older
    build, a registration that does not check): served without the store, its address written under the
    group's name for the hold (again and again, over the good group's own re-registration) and the table
    published again so routers read it now. Its partial sums have the right shape and would change answers:
    routers must refuse them and serve its tokens from the experts' other replicas. Lifted by stopping it and
    writing the good address back; whole again once the table lists what it did before, nothing of the group
    is quarantined and the router calls the good group again."""

    group: str
    name: str = "foreign-checkpoint-group"

    @property
    def description(self) -> str:
        return (
            f"expert group {self.group} started from another checkpoint of the same shapes: registering (refused), "
            "then its address written under the group's name for the hold"
        )

    def run(self, platform: ChaosPlatform, hold_s: float) -> Timeline:
        import threading

        from expertmesh.bench.chaos.platform import Child
        from expertmesh.expert_group.runtime import BANNER

        store, s = platform.store, platform.settings
        good, before = store.endpoints()[self.group], store.routing_table()
        foreign = foreign_checkpoint(platform.checkpoint.path, platform.placement_file.parent / "foreign-checkpoint")
        serve = ["group", "serve", "--model", str(foreign), "--placement", str(platform.placement_file)]
        serve += ["--group", self.group, "--host", platform.address_of(self.group), "--port", "0"]
        wrap = platform.wrap_for(self.group)
        evidence = []
        joining = Child(
            f"foreign-{self.group}-registering", [*serve, "--state-url", platform.redis.url], {}, s.log_dir, wrap
        )
        joining.start()
        try:
            joining.proc.wait(timeout=RECOVERY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            joining.stop()
        last = joining.tail(1).strip()
        refused = joining.proc.returncode == 2 and store.endpoints().get(self.group) == good
        evidence.append(f"registering: {last}" if refused else f"it registered (exit {joining.proc.returncode})")

        intruder = Child(f"foreign-{self.group}", serve, {}, s.log_dir, wrap).start()
        address = intruder.wait_for(BANNER.pattern, RECOVERY_TIMEOUT_S).group(2)
        lifting = threading.Event()

        def keep_writing() -> None:
            while not lifting.wait(0.2):
                try:
                    store.set_endpoint(self.group, address)
                except ConnectionError:
                    pass

        writer = threading.Thread(target=keep_writing, name="chaos-foreign-endpoint", daemon=True)
        injected = time.monotonic()
        store.set_endpoint(self.group, address)
        _bump_table(store)
        writer.start()
        try:
            _hold_until(injected, hold_s)
        finally:
            lifting.set()
            writer.join()
            intruder.stop()
            store.set_endpoint(self.group, good)
            _bump_table(store)
        lifted = time.monotonic()
        calls = sum(platform.describe(self.group).transport_calls.values())
        missing: list[str] = []

        def whole() -> bool:
            table = store.routing_table()
            quarantined = sorted((layer, e) for layer, e, g in store.quarantined() if g == self.group)
            served = platform.router_version()
            called = sum(platform.describe(self.group).transport_calls.values()) - calls
            # as sets: a replica the health monitor withdrew (it saw the foreign weights' fingerprints) and listed
            # again after its repair comes back last in its expert's tuple
            moved = sorted(p for p in before.replicas if set(table.replicas.get(p, ())) != set(before.replicas[p]))
            missing[:] = [
                *([f"the table lists other replicas than before for {moved[:4]}"] if moved else []),
                *([f"quarantined on {self.group}: {quarantined}"] if quarantined else []),
                *([f"the router on v{served}, the table v{table.version}"] if served < table.version else []),
                *([f"no call to {self.group} since the lift"] if called <= 0 else []),
            ]
            return not missing

        recovered = wait_until(whole, RECOVERY_TIMEOUT_S)
        mark = f"expert group {self.group} at {address} refused layer"
        refusals = [_message(line) for line in platform.router.lines if mark in line]
        evidence.append(f"the router refused it {len(refusals)} times" + (f": {refusals[0]}" if refusals else ""))
        note = "" if refusals else "the router never called the foreign group"
        if recovered is None:
            note = "; ".join([*missing, *([note] if note else [])])
        return Timeline(injected, lifted, recovered, note=note, evidence=tuple(evidence))


def _message(line: str) -> str:
    """A log line's message, whether the process logs text or JSON (``--log-format``)."""
    import json

    try:
        return str(json.loads(line)["message"])
    except (ValueError, KeyError, TypeError):
        return line.strip()


def sole_layer(table, groups: list[str]) -> tuple[int, str]:
    """(layer, group): the group holding the most experts of one layer (the fewest moves to make it their only
    holder), the first such in layer and group order."""
    held = {
        (layer, g): sum(1 for (lay, _), holders in table.replicas.items() if lay == layer and g in holders)
        for layer in sorted({lay for lay, _ in table.replicas})
        for g in groups
    }
    return max(held, key=lambda key: (held[key], -key[0], -groups.index(key[1])))


def _migrate_together(platform: ChaosPlatform, steps: list[tuple], attempts: int = 5) -> None:
    """Live migrations ``(layer, expert, mode, target, source)`` of distinct experts, all started at once (the
    orchestrator runs a few at a time) and waited for; BenchError unless each succeeds. One that failed because a
    group was unreachable is started again, a second apart, up to ``attempts`` times, as an operator would: just
    after a replica restarted, the orchestrator's channel to it may still be in its reconnect backoff."""
    for attempt in range(attempts):
        started = [platform.start_migration(*step) for step in steps]
        failed = []
        for step, migration in zip(steps, started):
            done = platform.wait_migration(migration)
            if done.phase != admin_pb.MIGRATION_PHASE_SUCCEEDED:
                failed.append((step, done))
        unreachable = [step for step, done in failed if "UNAVAILABLE" in done.reason]
        if not failed or len(unreachable) < len(failed) or attempt == attempts - 1:
            break
        steps = unreachable
        time.sleep(1.0)
    for step, done in failed:
        layer, expert, mode, *_ = step
        raise BenchError(
            f"migration of layer {layer} expert {expert} ({admin_pb.MigrationMode.Name(mode)}) ended "
            f"{admin_pb.MigrationPhase.Name(done.phase)}: {done.reason}"
        )


@dataclass(frozen=True)
class SoleGroupKilled:
    """Every expert of one MoE layer made one group's alone (live migrations: replicated onto it, evicted
    from the others), then SIGKILL of that group's replica under load: every token needs it at that layer.
    Until Ray Serve's new replica serves, requests must fail fast with UNAVAILABLE naming the group (no
    stream held past its deadline, the engine taking new requests), then complete again. Afterwards the
    layer's other replicas are made again."""

    layer: int
    group: str
    name: str = "sole-group-killed"

    @property
    def description(self) -> str:
        return (
            f"every expert of layer {self.layer} on group {self.group} alone, then SIGKILL of its replica "
            "(Ray Serve restarts it)"
        )

    def run(self, platform: ChaosPlatform, hold_s: float) -> Timeline:
        import grpc

        from expertmesh.bench.chaos.traffic import complete
        from expertmesh.client import Client

        store = platform.store
        before = store.routing_table()
        pairs = sorted(pair for pair in before.replicas if pair[0] == self.layer)
        others = {pair: [g for g in before.replicas[pair] if g != self.group] for pair in pairs}
        replicate, evict = admin_pb.MIGRATION_MODE_REPLICATE, admin_pb.MIGRATION_MODE_EVICT
        _migrate_together(
            platform, [(*p, replicate, self.group, others[p][0]) for p in pairs if self.group not in before.replicas[p]]
        )
        for k in range(max(len(o) for o in others.values())):  # one replica of each expert at a time
            _migrate_together(platform, [(*p, evict, "", o[k]) for p, o in others.items() if len(o) > k])
        sole = store.routing_table_version()
        if wait_until(lambda: platform.router_version() >= sole, RECOVERY_TIMEOUT_S) is None:
            raise BenchError(f"the router did not take routing table version {sole} up")
        pid = platform.describe(self.group).pid
        injected = time.monotonic()
        os.kill(pid, signal.SIGKILL)

        def served_again() -> bool:
            if platform.describe(self.group).pid == pid:
                return False
            try:  # a request through the router (the health monitor's probes reach the group too)
                complete(client, [3, 4, 5], 1)
            except grpc.RpcError:
                return False
            return True

        with Client(platform.target, timeout=platform.settings.group_timeout_s * 4) as client:
            recovered = wait_until(served_again, RECOVERY_TIMEOUT_S)
        _hold_until(injected, hold_s)
        for k in range(max(len(o) for o in others.values())):
            _migrate_together(platform, [(*p, replicate, o[k], self.group) for p, o in others.items() if len(o) > k])
        _migrate_together(
            platform, [(*p, evict, "", self.group) for p in pairs if self.group not in before.replicas[p]]
        )
        return Timeline(injected, injected, recovered)


def _router_beats_twice_after(platform: ChaosPlatform, wall: float, timeout_s: float) -> float | None:
    """time.monotonic() once the router has reported twice since ``wall`` (time.time()): its table watcher re-reads
    the quarantines every 0.25 s, well within two heartbeats (0.5 s apart), so by then it serves what changed."""
    beats: set[float] = set()

    def twice() -> bool:
        beats.update(b.at for b in platform.store.router_heartbeats().values() if b.at > wall)
        return len(beats) >= 2

    return wait_until(twice, timeout_s, poll_s=0.05)


def long_prompts(vocab: int, count: int, blocks: int = 3, seed: int = 7) -> list[list[int]]:
    """``count`` prompts of ``blocks`` full 16-token KV blocks and a few tokens more (the prefix cache keeps
    full blocks only), seeded."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (16 * blocks + 3,), generator=gen).tolist() for _ in range(count)]


@dataclass(frozen=True)
class ReleasedAfterDegradedPrefix:
    """Every replica of one expert quarantined on every MoE layer by the operator (``expertmesh quarantine``):
    routers serve around it (degraded). Long prompts sent meanwhile (each twice: the second may find the
    first's blocks) have their KV blocks computed around the expert; then the expert is released and the same
    prompts sent again. After the release they must be the references of before the quarantine: a prefix cache
    that outlived the routing it was computed under served the quarantine's keys and values, status OK (issue
    39). The fault's own requests (``probes``) count with the clients'; those sent while the router fell back
    count as ``degraded`` when they differ, every later one as ``wrong``."""

    expert: int
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    name: str = "released-after-degraded-prefix"

    @property
    def description(self) -> str:
        return (
            f"expert {self.expert} quarantined on every layer and every group; {len(self.prompts)} prompts of "
            f"{len(self.prompts[0])} tokens served around it (twice each), the expert released, the same prompts again"
        )

    def run(self, platform: ChaosPlatform, hold_s: float) -> Timeline:
        from expertmesh.bench.chaos.probes import grpc_send, probe
        from expertmesh.client import Client
        from expertmesh.orchestrator import admin_client

        layers = platform.spec.moe_layers
        channel, stub = admin_client.connect(platform.admin_address)
        probes = []
        try:
            with Client(platform.target, timeout=60) as client:
                send = [grpc_send(client, list(p), self.max_new_tokens) for p in self.prompts]
                reference = tuple(tuple(s(lambda n: None)) for s in send)
                injected, wall = time.monotonic(), time.time()
                for layer in layers:
                    admin_client.call(stub.Quarantine, admin_pb.QuarantineRequest(layer=layer, expert=self.expert))
                if _router_beats_twice_after(platform, wall, RECOVERY_TIMEOUT_S) is None:
                    raise BenchError("the router did not report after the quarantine")
                for _ in range(2):
                    probes += [probe(i, s) for i, s in enumerate(send)]
                _hold_until(injected, hold_s)
                release = _Release(stub, layers, self.expert)
                release.all()
                lifted = time.monotonic()
                # Released replicas are repaired, then on probation (still out of service) for a few health
                # rounds: the router falls back until their quarantine entries go. A repair that did not take
                # (its group busy restarting, say) leaves its replica quarantined with the reason: released
                # again, as an operator who reads `expertmesh experts` does.
                gone = wait_until(lambda: release.settled(platform.store), RECOVERY_TIMEOUT_S)
                fallback_until = None
                if gone is not None:
                    fallback_until = _router_beats_twice_after(platform, time.time(), RECOVERY_TIMEOUT_S)
                probes += [probe(i, s) for i, s in enumerate(send)]
        finally:
            channel.close()
        degraded = sum(r.ok and r.tokens != reference[r.client] for r in probes[: 2 * len(send)])
        return Timeline(
            injected,
            lifted,
            time.monotonic() if fallback_until is not None else None,
            fallback_until=fallback_until,
            probes=tuple(probes),
            probe_reference=reference,
            evidence=(
                f"{degraded} of {2 * len(send)} completions around the quarantine differed from the references "
                "(the fallback's); every later one must not",
                release.summary(),
            ),
            note="" if gone is not None else f"still out of service after the release: {release.left}",
        )


class _Release:
    """An operator's release of one expert on every MoE layer, again for the replicas whose repair did not take
    (each still quarantined, with the reason), at most every ``every_s``; what was left when it gave up."""

    def __init__(self, stub, layers, expert: int, every_s: float = 10.0) -> None:
        self._stub, self._layers, self._expert, self._every_s = stub, tuple(layers), expert, every_s
        self.rounds, self.refusals, self.left = 0, [], ""
        self._last = 0.0

    def all(self, layers=None) -> None:
        from expertmesh.orchestrator import admin_client

        self.rounds += 1
        self._last = time.monotonic()
        for layer in self._layers if layers is None else layers:
            try:
                admin_client.call(self._stub.Release, admin_pb.ReleaseRequest(layer=layer, expert=self._expert))
            except ExpertMeshError as err:  # nothing quarantined left on that layer: its repair took meanwhile
                self.refusals.append(f"layer {layer}: {err}")

    def settled(self, store) -> bool:
        """No entry of the expert left; else those still quarantined (not on probation) released again."""
        mine = {k: q for k, q in store.quarantined().items() if k[1] == self._expert}
        self.left = "; ".join(f"layer {k[0]} on {k[2]}: {q.state} ({q.reason})" for k, q in sorted(mine.items()))
        stuck = sorted({k[0] for k, q in mine.items() if q.state == HealthState.QUARANTINED.value})
        if stuck and time.monotonic() - self._last >= self._every_s:
            self.all(stuck)
        return not mine

    def summary(self) -> str:
        return f"released in {self.rounds} round(s); refused: {self.refusals or 'none'}"


@dataclass(frozen=True)
class RedisFrozenUnderHttpPrefer:
    """redis-server frozen (SIGSTOP) for ``down_s`` while clients stream over the OpenAI-compatible HTTP API
    with the ``prefer`` routing policy (which reads a domain's capability profile) and ``/health/live`` is
    polled every 50 ms. Before issue 39 such a request read the store on the HTTP server's event loop, under a
    lock every such request takes: every stream and the liveness probe waited for the socket timeout, and
    Kubernetes restarted the router. Profiles are read off the request path now; the router serves on what it
    read last. ``health_live_max_ms`` is the longest the liveness probe waited (target: under 100 ms)."""

    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    domain: str = "code"
    down_s: float = 10.0
    name: str = "redis-frozen-http-prefer"

    @property
    def description(self) -> str:
        return (
            f"redis-server frozen (SIGSTOP) for {self.down_s:g} s under {len(self.prompts)} HTTP clients with "
            f"routing_policy prefer (domain {self.domain}), /health/live polled every 50 ms; then SIGCONT"
        )

    def run(self, platform: ChaosPlatform, hold_s: float) -> Timeline:
        import threading

        import numpy as np

        from expertmesh.bench.chaos.probes import LivenessWatch, http_send, probe
        from expertmesh.router.policy.profiles import build_profiles, save_profiles

        layers = tuple(platform.spec.moe_layers)
        gen = np.random.default_rng(3)
        loads = {self.domain: gen.integers(1, 50, (len(layers), platform.spec.num_experts)).astype(float)}
        save_profiles(platform.store, build_profiles(loads, layers))
        model = platform.checkpoint.path.name
        body = lambda p: {  # noqa: E731
            "model": model,
            "prompt": list(p),
            "max_tokens": self.max_new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "routing_policy": "prefer",
            "domain": self.domain,
        }
        send = [http_send(platform.http_url, body(p), 60) for p in self.prompts]
        first = [probe(i, s) for i, s in enumerate(send)]  # the references; the router reads the profile now
        if not all(r.ok for r in first):
            raise BenchError(f"an HTTP prefer request failed before the fault: {[r.error for r in first if not r.ok]}")
        reference = tuple(r.tokens for r in first)
        probes, stop = [], threading.Event()

        def client(i: int) -> None:
            while not stop.is_set():
                probes.append(probe(i, send[i]))

        redis = platform.redis.proc
        watch = LivenessWatch(platform.http_url).start()
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(send))]
        for t in threads:
            t.start()
        try:
            injected, _ = held(
                lambda: redis.send_signal(signal.SIGSTOP), lambda: redis.send_signal(signal.SIGCONT), self.down_s
            )
            lifted, recovered = lifted_until_the_router_reports(platform)
        finally:
            stop.set()
            for t in threads:
                t.join()
            longest = watch.stop()
        return Timeline(
            injected,
            lifted,
            recovered,
            probes=tuple(probes),
            probe_reference=reference,
            health_live_max_s=longest,
            evidence=(f"/health/live answered {watch.checks} probes, the slowest in {1e3 * longest:.0f} ms",),
        )


@dataclass(frozen=True)
class FlushedDuringQuarantine:
    """An operator's quarantine of one replica of an expert (its other replica serves on), that replica's weights
    then scaled by ``factor`` (so any token it serves is a wrong answer with status OK), then FLUSHALL, which
    takes the quarantine entries and health records with the table. The orchestrator must put the quarantine
    back before any table, and rebuild the table without the replica: no request may be served by it. Lifted by
    an operator's release (reload from the checkpoint, probation), then healthy and listed again."""

    layer: int
    expert: int
    group: str
    factor: float = 2.0
    name: str = "flush-during-quarantine"

    @property
    def description(self) -> str:
        return (
            f"layer {self.layer} expert {self.expert} quarantined on {self.group} by an operator, its weights there "
            f"scaled by {self.factor:g}, then FLUSHALL; released after the hold"
        )

    def run(self, platform: ChaosPlatform, hold_s: float) -> Timeline:
        from expertmesh.orchestrator import admin_client

        store, pair, key = platform.store, (self.layer, self.expert), (self.layer, self.expert, self.group)
        channel, admin = admin_client.connect(platform.admin_address)
        with channel:
            request = admin_pb.QuarantineRequest(layer=self.layer, expert=self.expert, group=self.group)
            admin_client.call(admin.Quarantine, request)
            withdrawn = store.routing_table_version()
            if wait_until(lambda: platform.router_version() >= withdrawn, RECOVERY_TIMEOUT_S) is None:
                raise BenchError("the router never took the table without the quarantined replica")
            platform.channels.inject_fault(self.group, pair, pb.FAULT_KIND_SCALE, self.factor)
            before = max(store.routing_table_version(), platform.router_version())
            injected = time.monotonic()
            platform.redis.flush()

            def quarantine_back() -> bool:
                """The operator's quarantine back in the store, and the router on a rebuilt table without it."""
                table = store.routing_table()
                if table is None or table.version <= before or platform.router_version() < table.version:
                    return False
                record = health_state.load_all(store).get(ReplicaId(*key))
                return (
                    set(store.endpoints()) == set(platform.groups)
                    and self.group not in table.replicas[pair]
                    and key in store.quarantined()
                    and record is not None
                    and record.state is HealthState.QUARANTINED
                    and record.quarantined_by is Initiator.OPERATOR
                )

            back = wait_until(quarantine_back, RECOVERY_TIMEOUT_S)
            _hold_until(injected, hold_s)
            # lifted, as an operator does: reload from the checkpoint (the scaled weights go), then probation
            release = admin_pb.ReleaseRequest(layer=self.layer, expert=self.expert, group=self.group)
            try:
                admin_client.call(admin.Release, release)
            except ExpertMeshError as err:  # the quarantine was lost: nothing of it left to release
                released = f"; its release: {err}"
            else:
                released = ""
        lifted = time.monotonic()
        if back is None:
            return Timeline(injected, lifted, None, note=f"the quarantine did not come back after the flush{released}")

        seen: list[str] = []

        def whole() -> bool:
            record = health_state.load_all(store).get(ReplicaId(*key))
            table = store.routing_table()
            served = platform.router_version()
            state = None if record is None else f"{record.state.value} ({record.reason})"
            seen[:] = [
                f"record {state}, listed {self.group in table.replicas[pair]}, entry {key in store.quarantined()}"
            ]
            seen[0] += f", table v{table.version}, router on v{served}"
            return (
                record is not None
                and record.state is HealthState.HEALTHY
                and self.group in table.replicas[pair]
                and key not in store.quarantined()
                and served >= table.version
            )

        recovered = wait_until(whole, RECOVERY_TIMEOUT_S)
        note = f"quarantine back after {back - injected:.1f} s"
        if recovered is None:  # what was still missing, for whoever reads the report
            note += f"; at the timeout: {seen[0] if seen else 'nothing read'}"
        return Timeline(injected, lifted, recovered, note=note)
