"""In-process state backend: the embedded default. Thread-safe; not shared across processes."""

from __future__ import annotations

import threading


class MemoryBackend:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, bytes] = {}
        self._hashes: dict[str, dict[str, bytes]] = {}

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._values.get(key)

    def compare_and_set_many(self, guard_key: str, expected: bytes | None, items: dict[str, bytes]) -> bool:
        with self._lock:
            if self._values.get(guard_key) != expected:
                return False
            self._values.update(items)
            return True

    def hset(self, key: str, field: str, value: bytes) -> None:
        with self._lock:
            self._hashes.setdefault(key, {})[field] = value

    def hdel(self, key: str, field: str) -> None:
        with self._lock:
            self._hashes.get(key, {}).pop(field, None)

    def hgetall(self, key: str) -> dict[str, bytes]:
        with self._lock:
            return dict(self._hashes.get(key, {}))

    def hget(self, key: str, field: str) -> bytes | None:
        with self._lock:
            return self._hashes.get(key, {}).get(field)

    def hlen(self, key: str) -> int:
        with self._lock:
            return len(self._hashes.get(key, {}))

    def close(self) -> None:
        pass
