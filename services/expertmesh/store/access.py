"""Who may read and write each key of the state store: the key layout as data (``LAYOUT``), and the Redis ACL
rules derived from it (``acl_rules``, ``acl_file``), so the Redis user of each component cannot drift from the
keys the store uses: ``StateStore`` refuses to touch a key ``LAYOUT`` does not declare.

Glossary
- *role*: the component a Redis user is for (``Role``). Routers read the routing table, endpoints, profiles,
  policy-quality records and quarantines, and write their heartbeats, load windows, hidden-state samples and
  anomaly records; expert groups read the table and write their registration (``endpoints``); the orchestrator
  reads every key and writes the rest. Operators' commands that write the store (``profile build --state-url``, ``policy
  eval``, ``kubectl expertmesh``) use the orchestrator's user.
- *key*: one name under the deployment's prefix ``expertmesh:<deployment>:`` (``StoreKey.name``); a name ending
  in ``:*`` is a family (``hidden_samples:<layer>``).

Example::

    >>> acl_rules(Role.EXPERT_GROUP, "expertmesh:x")[-3:]
    ['%R~expertmesh:x:routing_table', '%R~expertmesh:x:routing_table:version', '~expertmesh:x:endpoints']
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["LAYOUT", "Role", "StoreKey", "acl_file", "acl_rules", "declared"]


class Role(StrEnum):
    """A component with a Redis user of its own; the value is the user's name."""

    ROUTER = "router"
    EXPERT_GROUP = "expert-group"
    ORCHESTRATOR = "orchestrator"


class KeyKind(StrEnum):
    STRING = "string"
    HASH = "hash"


ROUTER, GROUP, ORCHESTRATOR = Role.ROUTER, Role.EXPERT_GROUP, Role.ORCHESTRATOR


@dataclass(frozen=True)
class StoreKey:
    """One key (or family of keys) of the store and who may read and write it (a writer may read it too)."""

    name: str
    kind: KeyKind
    readers: frozenset[Role]
    writers: frozenset[Role]

    @property
    def family(self) -> bool:
        return self.name.endswith(":*")

    def covers(self, name: str) -> bool:
        return name.startswith(self.name[:-1]) if self.family else name == self.name


def _key(name: str, kind: KeyKind, readers: set[Role], writers: set[Role]) -> StoreKey:
    return StoreKey(name, kind, frozenset(readers | writers), frozenset(writers))


STRING, HASH = KeyKind.STRING, KeyKind.HASH

#: every key of the store (``expertmesh.store``'s docstring says what each holds)
LAYOUT: tuple[StoreKey, ...] = (
    _key("routing_table", STRING, {ROUTER, GROUP}, {ORCHESTRATOR}),
    _key("routing_table:version", STRING, {ROUTER, GROUP}, {ORCHESTRATOR}),
    _key("placement", HASH, set(), {ORCHESTRATOR}),
    # groups register themselves; the orchestrator's embedded form (`up`) registers the groups it starts
    _key("endpoints", HASH, {ROUTER}, {GROUP, ORCHESTRATOR}),
    # routers write their own records; the orchestrator deletes those of routers gone (``orchestrator.retention``)
    _key("load", HASH, {ORCHESTRATOR}, {ROUTER, ORCHESTRATOR}),
    _key("load_detail", HASH, {ORCHESTRATOR}, {ROUTER, ORCHESTRATOR}),
    _key("routers", HASH, {ORCHESTRATOR}, {ROUTER, ORCHESTRATOR}),
    _key("migrations", HASH, set(), {ORCHESTRATOR}),
    _key("groups", HASH, set(), {ORCHESTRATOR}),
    _key("quarantine", HASH, {ROUTER}, {ORCHESTRATOR}),
    _key("profiles", HASH, {ROUTER}, {ORCHESTRATOR}),
    _key("policy_quality", HASH, {ROUTER}, {ORCHESTRATOR}),
    _key("health", HASH, set(), {ORCHESTRATOR}),
    _key("hidden_samples:*", HASH, {ORCHESTRATOR}, {ROUTER, ORCHESTRATOR}),
    _key("health_probes", HASH, set(), {ORCHESTRATOR}),
    _key("anomalies", HASH, {ORCHESTRATOR}, {ROUTER, ORCHESTRATOR}),
)

#: Redis commands each kind of access uses (``store._redis.RedisBackend``): a compare-and-set of strings is
#: WATCH, GET, MULTI, MSET, EXEC (UNWATCH when the guard moved)
_COMMANDS = {
    (STRING, "read"): ("get",),
    (STRING, "write"): ("get", "watch", "unwatch", "multi", "mset", "exec"),
    (HASH, "read"): ("hgetall", "hget", "hlen"),
    (HASH, "write"): ("hgetall", "hget", "hlen", "hset", "hdel"),
}
#: what every user may run: a health check and the database of its URL (redis-py's CLIENT SETINFO on connect
#: may be refused: it carries on; the command is not known before Redis 7.2 either)
_ALWAYS = ("ping", "select")


def declared(name: str) -> StoreKey:
    """The layout's entry of ``name`` (a key under the deployment prefix); KeyError for an undeclared one."""
    for key in LAYOUT:
        if key.covers(name):
            return key
    raise KeyError(f"state store key {name!r} is not declared in expertmesh.store.access.LAYOUT")


def acl_rules(role: Role, namespace: str) -> list[str]:
    """The Redis ACL rules of ``role``'s user over the keys under ``namespace`` (``expertmesh:<deployment>``):
    no command or key beyond what ``LAYOUT`` gives it; read-only keys as ``%R~``, written ones as ``~``."""
    commands: set[str] = set(_ALWAYS)
    keys: list[str] = []
    for key in LAYOUT:
        if role in key.writers:
            access, prefix = "write", "~"
        elif role in key.readers:
            access, prefix = "read", "%R~"
        else:
            continue
        commands.update(_COMMANDS[(key.kind, access)])
        keys.append(f"{prefix}{namespace}:{key.name}")
    return ["resetkeys", "resetchannels", "-@all", *(f"+{c}" for c in sorted(commands)), *keys]


def acl_file(namespace: str, passwords: Mapping[Role, str] | None = None) -> str:
    """A Redis ACL file (``aclfile``) with one user per role and the ``default`` user off. With ``passwords``,
    each user holds the SHA-256 of its password (the plain text never reaches Redis); without, a user has no
    password yet (none can log in until one is added: ``>PASSWORD``)."""
    lines = ["user default off"]  # an ACL file has no comments
    for role in Role:
        secret = []
        if passwords is not None:
            secret = [f"#{hashlib.sha256(passwords[role].encode()).hexdigest()}"]
        lines.append(" ".join(["user", role.value, "on", *secret, *acl_rules(role, namespace)]))
    return "\n".join(lines) + "\n"
