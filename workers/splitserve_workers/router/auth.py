"""API keys for the router's client port: `Authorization: Bearer <key>`, as OpenAI clients send
it (the `openai` client's `api_key`, or `OPENAI_API_KEY`).

Keys come from a file (`--api-key-file`: one key per line, `#` comments; on Kubernetes a
mounted Secret) and from the environment (`SPLITSERVE_API_KEY`, comma-separated). The file is
re-read when it changes, so a Secret rotated in place takes effect without a restart; a file
that vanishes or cannot be read keeps the keys last read (kubelet swaps a Secret's files
atomically, and a moment without the file must neither open the port nor lock everyone out).
Comparisons take constant time. With no key source configured, the port is open.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("splitserve.router")

ENV_VAR = "SPLITSERVE_API_KEY"
RECHECK_SECONDS = 1.0  # how often the key file's metadata is looked at (on requests)
MAX_KEY_FILE_BYTES = 64 << 10
MAX_KEY_BYTES = 512  # longer keys (and Authorization headers) are refused unread


class ApiKeyError(ValueError):
    """A key source that cannot be used at start-up (the router exits 2 naming it)."""


def _parse(text: str) -> list[bytes]:
    keys = []
    for line in text.splitlines():
        key = line.strip()
        if key and not key.startswith("#"):
            keys.append(key.encode())
    return keys


class ApiKeys:
    def __init__(
        self,
        path: str | None = None,
        env: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path) if path else None
        self._clock = clock
        self._env_keys = [k.strip().encode() for k in (env or "").split(",") if k.strip()]
        self._file_keys: list[bytes] = []
        self._stamp: tuple[int, int, int] | None = None  # (inode, size, mtime_ns) last read
        self._checked = 0.0
        self._complained = False
        if env and not self._env_keys:
            # Set to something (",", " ") that holds no key: refused, as a keyless file is,
            # rather than serving the API open. An empty value stays "no keys from here".
            raise ApiKeyError(f"{ENV_VAR}: {env!r} holds no key (comma-separated keys)")
        for key in self._env_keys:
            if len(key) > MAX_KEY_BYTES:
                raise ApiKeyError(f"{ENV_VAR}: a key is longer than {MAX_KEY_BYTES} bytes")
        if self.path is not None:
            try:
                self._read()
            except OSError as e:
                raise ApiKeyError(f"--api-key-file: cannot read {self.path}: {e.strerror}") from e
            if not self._file_keys:
                raise ApiKeyError(f"--api-key-file: {self.path} holds no key")

    @classmethod
    def from_environment(cls, path: str | None) -> ApiKeys:
        return cls(path, os.environ.get(ENV_VAR))

    @property
    def enabled(self) -> bool:
        return self.path is not None or bool(self._env_keys)

    def _read(self) -> None:
        assert self.path is not None
        st = self.path.stat()
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self._stamp:
            return
        if st.st_size > MAX_KEY_FILE_BYTES:
            raise OSError(0, f"larger than {MAX_KEY_FILE_BYTES} bytes")
        keys = _parse(self.path.read_text())
        if any(len(k) > MAX_KEY_BYTES for k in keys):
            raise OSError(0, f"a key is longer than {MAX_KEY_BYTES} bytes")
        if self._stamp is not None and keys != self._file_keys:
            log.info("API keys re-read from %s: %d key(s)", self.path, len(keys))
        self._file_keys, self._stamp = keys, stamp
        self._complained = False

    def _refresh(self) -> None:
        now = self._clock()
        if self.path is None or now - self._checked < RECHECK_SECONDS:
            return
        self._checked = now
        try:
            self._read()
        except OSError as e:
            if not self._complained:
                log.warning(
                    "cannot read API keys from %s (%s); keeping the %d key(s) read before",
                    self.path, e.strerror or e, len(self._file_keys),
                )  # fmt: skip
                self._complained = True

    def allows(self, authorization: str | None) -> bool:
        """Whether an Authorization header carries a valid key (always, when disabled)."""
        if not self.enabled:
            return True
        self._refresh()
        if not authorization or len(authorization) > MAX_KEY_BYTES + 16:
            return False
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = token.strip().encode("utf-8", "replace")
        # Every key is compared (no early exit), each in constant time.
        ok = False
        for key in (*self._file_keys, *self._env_keys):
            ok |= hmac.compare_digest(given, key)
        return ok
