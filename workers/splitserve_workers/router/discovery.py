"""Where the router finds its workers. An interface with three answers: a static list of host:port
(local mode, tests), DNS of headless Kubernetes Services, whose A records are the ready pods
(the Service's readiness gating is what keeps a draining pod out), and a JSON file another
process rewrites (local mode's autoscaler). picking.py polls it."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from abc import ABC, abstractmethod
from typing import cast

from splitserve_workers.protocol import endpoint_problem

ROLES = ("prefill", "decode", "colocated")

log = logging.getLogger("splitserve.router")


def split_endpoints(text: str | list[str] | None) -> list[str]:
    """'a:1,b:2' or ['a:1', 'b:2'] -> ['a:1', 'b:2'] (validated host:port)."""
    if not text:
        return []
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        if (why := endpoint_problem(item)) is not None:
            raise ValueError(f"endpoint {item!r} {why}")
        out.append(item)
    return out


class Discovery(ABC):
    """Answers: which endpoints serve `role` right now."""

    @abstractmethod
    async def endpoints(self, role: str) -> list[str]: ...

    @abstractmethod
    def roles(self) -> list[str]:
        """The roles this deployment has (prefill+decode, or colocated)."""


class StaticDiscovery(Discovery):
    def __init__(
        self,
        prefill: list[str] | None = None,
        decode: list[str] | None = None,
        colocated: list[str] | None = None,
    ) -> None:
        self._by_role = {
            "prefill": list(prefill or []),
            "decode": list(decode or []),
            "colocated": list(colocated or []),
        }

    async def endpoints(self, role: str) -> list[str]:
        return list(self._by_role[role])

    def roles(self) -> list[str]:
        return [r for r in ROLES if self._by_role[r]]


class DnsDiscovery(Discovery):
    """Resolves 'name:port' of a headless Service to one 'ip:port' per ready pod. A name that
    does not resolve (a headless Service with no ready pod: a pool at zero) is an empty pool; a
    lookup that fails otherwise (a resolver timeout) keeps the last good answer, so a DNS
    hiccup does not empty the pool. Each change between answering and failing is logged."""

    def __init__(self, services: dict[str, str]) -> None:
        for role, service in services.items():
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r}")
            split_endpoints(service)  # validates host:port
        self._services = {r: s for r, s in services.items() if s}
        self._last: dict[str, list[str]] = {}
        self._failing: dict[str, str] = {}  # role -> the error last logged

    async def endpoints(self, role: str) -> list[str]:
        service = self._services.get(role)
        if not service:
            return []
        host, _, port = service.rpartition(":")
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(
                host, int(port), family=socket.AF_INET, type=socket.SOCK_STREAM
            )
        except OSError as e:
            errno = getattr(e, "errno", None)
            empty = errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None))
            if self._failing.get(role) != str(e):
                self._failing[role] = str(e)
                log.warning(
                    "%s discovery: %s does not resolve (%s)%s", role, host, e,
                    ": no ready worker" if empty else "; keeping the last answer",
                )  # fmt: skip
            if empty:
                self._last[role] = []
            return list(self._last.get(role, []))
        if self._failing.pop(role, None) is not None:
            log.info("%s discovery: %s resolves again", role, host)
        found = sorted({f"{cast(str, info[4][0])}:{cast(int, info[4][1])}" for info in infos})
        self._last[role] = found
        return found

    def roles(self) -> list[str]:
        return [r for r in ROLES if r in self._services]


# A workers file is a few endpoints; anything near this is not one.
MAX_WORKERS_FILE_BYTES = 1 << 20


Stamp = tuple[int, int, int]  # inode, mtime_ns, size: a rename or a rewrite changes it


def read_workers_file(path: str) -> tuple[dict[str, list[str]], Stamp]:
    """{"prefill": ["host:port", ...], "decode": [...], "colocated": [...]} (roles optional),
    and the stamp of the file actually read; ValueError says what is wrong with it."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            raw = f.read(MAX_WORKERS_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"workers file {path}: {e.strerror}") from None
    stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
    if len(raw) > MAX_WORKERS_FILE_BYTES:
        raise ValueError(f"workers file {path}: over {MAX_WORKERS_FILE_BYTES} bytes")
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"workers file {path}: not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"workers file {path}: must be an object of role -> [host:port, ...]")
    out: dict[str, list[str]] = {}
    for role, endpoints in data.items():
        if role not in ROLES:
            raise ValueError(f"workers file {path}: unknown role {role!r}")
        if not isinstance(endpoints, list) or not all(isinstance(e, str) for e in endpoints):
            raise ValueError(f"workers file {path}: {role} must be a list of host:port strings")
        try:
            out[role] = split_endpoints(endpoints)
        except ValueError as e:
            raise ValueError(f"workers file {path}: {role}: {e}") from None
    return out, stamp


class FileDiscovery(Discovery):
    """Endpoints from a JSON file that another process rewrites (atomically, by rename) as it
    adds and removes workers: local mode's autoscaler. Re-read when it changes; a file that
    becomes unreadable, missing or invalid keeps the last good answer (and says so once). The
    roles are those of the first read; a role missing from a later one has no endpoints."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._by_role, self._stamp = read_workers_file(path)
        self._roles = [r for r in ROLES if r in self._by_role]
        self._warned = False

    def _warn(self, problem: str) -> None:
        if not self._warned:
            log.warning("%s; keeping the last good worker list", problem)
            self._warned = True

    def _reload(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError as e:
            self._warn(f"workers file {self.path}: {e.strerror}")
            return
        if (st.st_ino, st.st_mtime_ns, st.st_size) == self._stamp:
            return
        try:
            found, stamp = read_workers_file(self.path)
            added = [r for r in found if r not in self._roles and found[r]]
            if added:
                raise ValueError(
                    f"workers file {self.path}: the roles cannot change at run time "
                    f"({', '.join(added)} is new)"
                )
        except ValueError as e:
            self._warn(str(e))
            return
        self._by_role = {r: found.get(r, []) for r in self._roles}
        self._stamp, self._warned = stamp, False

    async def endpoints(self, role: str) -> list[str]:
        self._reload()
        return list(self._by_role.get(role, []))

    def roles(self) -> list[str]:
        return list(self._roles)
