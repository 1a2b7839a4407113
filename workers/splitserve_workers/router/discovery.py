"""Where the router finds its workers. An interface with two answers: a static list of host:port
(local mode, tests) and DNS of headless Kubernetes Services, whose A records are the ready pods
(the Service's readiness gating is what keeps a draining pod out). picking.py polls it."""

from __future__ import annotations

import asyncio
import socket
from abc import ABC, abstractmethod
from typing import cast

ROLES = ("prefill", "decode", "colocated")


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
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"endpoint {item!r} is not host:port")
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
    """Resolves 'name:port' of a headless Service to one 'ip:port' per ready pod. A lookup that
    fails keeps the last good answer, so a DNS hiccup does not empty the pool."""

    def __init__(self, services: dict[str, str]) -> None:
        for role, service in services.items():
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r}")
            split_endpoints(service)  # validates host:port
        self._services = {r: s for r, s in services.items() if s}
        self._last: dict[str, list[str]] = {}

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
        except OSError:
            return list(self._last.get(role, []))
        found = sorted({f"{cast(str, info[4][0])}:{cast(int, info[4][1])}" for info in infos})
        self._last[role] = found
        return found

    def roles(self) -> list[str]:
        return [r for r in ROLES if r in self._services]
