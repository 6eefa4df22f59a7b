"""Redis state backend for clusters. Compare-and-set uses WATCH/MULTI, so two
orchestrators editing the routing table never overwrite each other. Redis
failures surface as the builtin ``ConnectionError``, the store's one error for
"unreachable", whichever backend is in use."""

from __future__ import annotations

import functools
import os

import redis


def _unreachable_as_connection_error(method):
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as err:
            raise ConnectionError(f"the Redis state store is unreachable: {err}") from None

    return wrapped


class RedisBackend:
    def __init__(self, url: str) -> None:
        # Credentials stay out of URLs that end up in logs and manifests (the Helm chart mounts them).
        options: dict = {"socket_timeout": 5, "socket_connect_timeout": 5}
        if os.environ.get("EXPERTMESH_REDIS_PASSWORD"):
            options["password"] = os.environ["EXPERTMESH_REDIS_PASSWORD"]
        if url.startswith("rediss://") and os.environ.get("EXPERTMESH_REDIS_CA_FILE"):
            options["ssl_ca_certs"] = os.environ["EXPERTMESH_REDIS_CA_FILE"]
        self._client = redis.Redis.from_url(url, **options)
        try:
            self._client.ping()
        except redis.RedisError as err:
            raise ConnectionError(f"cannot reach the Redis state store at {url}: {err}") from None

    @_unreachable_as_connection_error
    def get(self, key: str) -> bytes | None:
        return self._client.get(key)

    @_unreachable_as_connection_error
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

    @_unreachable_as_connection_error
    def hset(self, key: str, field: str, value: bytes) -> None:
        self._client.hset(key, field, value)

    @_unreachable_as_connection_error
    def hdel(self, key: str, field: str) -> None:
        self._client.hdel(key, field)

    @_unreachable_as_connection_error
    def hgetall(self, key: str) -> dict[str, bytes]:
        return {k.decode(): v for k, v in self._client.hgetall(key).items()}

    def close(self) -> None:
        self._client.close()
