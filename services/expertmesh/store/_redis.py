"""Redis state backend for clusters. Compare-and-set uses WATCH/MULTI, so two
orchestrators editing the routing table never overwrite each other. Redis
failures surface as the builtin ``ConnectionError``, the store's one error for
"unreachable", whichever backend is in use; a command the process's Redis user
may not run on a key (its ACL, ``store.access``) as ``StoreAccessDenied``.

Credentials come from ``RedisAuthConfig`` (``EXPERTMESH_REDIS_*``: a user and a
password file), never from the URL, which ends up in logs and manifests."""

from __future__ import annotations

import functools

import redis

from expertmesh.config.settings import RedisAuthConfig
from expertmesh.contracts.errors import StoreAccessDenied


def _translated(method):
    """Unreachable -> ConnectionError; refused by the user's ACL -> StoreAccessDenied naming the call and key."""

    @functools.wraps(method)
    def wrapped(self, key, *args, **kwargs):
        try:
            return method(self, key, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as err:
            raise ConnectionError(f"the Redis state store is unreachable: {err}") from None
        except redis.exceptions.NoPermissionError as err:
            raise StoreAccessDenied(
                f"the Redis state store refused {method.__name__} of {key!r} to user {self.user!r} ({err}): this "
                "component's Redis user may not do that; `expertmesh store acl` lists what each component's may"
            ) from None

    return wrapped


class RedisBackend:
    def __init__(self, url: str, auth: RedisAuthConfig | None = None) -> None:
        auth = auth if auth is not None else RedisAuthConfig()
        #: the ACL user this process is ("default": none given)
        self.user = auth.username or "default"
        options: dict = {"socket_timeout": 5, "socket_connect_timeout": 5}
        if auth.username:
            options["username"] = auth.username
        password = auth.secret()
        if password:
            options["password"] = password
        if url.startswith("rediss://") and auth.ca_file is not None:
            options["ssl_ca_certs"] = str(auth.ca_file)
        self._client = redis.Redis.from_url(url, **options)
        try:
            self._client.ping()
        except redis.AuthenticationError as err:
            raise ConnectionError(
                f"the Redis state store at {url} refused user {self.user!r}: {err} "
                "(EXPERTMESH_REDIS_USERNAME and EXPERTMESH_REDIS_PASSWORD_FILE)"
            ) from None
        except redis.RedisError as err:
            raise ConnectionError(f"cannot reach the Redis state store at {url}: {err}") from None

    @_translated
    def get(self, key: str) -> bytes | None:
        return self._client.get(key)

    @_translated
    def compare_and_set_many(self, guard_key: str, expected: bytes | None, items: dict[str, bytes]) -> bool:
        with self._client.pipeline() as pipe:
            try:
                pipe.watch(guard_key)
                if pipe.get(guard_key) != expected:
                    pipe.unwatch()
                    return False
                pipe.multi()
                pipe.mset(items)
                pipe.execute()
                return True
            except redis.WatchError:
                return False

    @_translated
    def hset(self, key: str, field: str, value: bytes) -> None:
        self._client.hset(key, field, value)

    @_translated
    def hdel(self, key: str, field: str) -> None:
        self._client.hdel(key, field)

    @_translated
    def hgetall(self, key: str) -> dict[str, bytes]:
        return {k.decode(): v for k, v in self._client.hgetall(key).items()}

    @_translated
    def hget(self, key: str, field: str) -> bytes | None:
        return self._client.hget(key, field)

    @_translated
    def hlen(self, key: str) -> int:
        return int(self._client.hlen(key))

    def close(self) -> None:
        self._client.close()
