"""What both ends of a gRPC call agree on beyond the messages in protos/: kept in one place so
the side that writes it and the side that reads it cannot drift apart. Imports nothing heavy
(the router uses it)."""

from __future__ import annotations

import re

# host:port, where host is a DNS name, an IPv4 address or a bracketed IPv6 address. A DNS name
# is at most 253 characters, so no endpoint is longer than this.
MAX_ENDPOINT_CHARS = 261
_HOST = re.compile(r"\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+")


def endpoint_problem(endpoint: str) -> str | None:
    """Why `endpoint` is not a worker's host:port (as the router's discovery gives them and a
    PrefillRequest's decode_endpoint carries), or None."""
    if len(endpoint) > MAX_ENDPOINT_CHARS:
        return f"is {len(endpoint)} characters, more than any host:port ({MAX_ENDPOINT_CHARS})"
    host, sep, port = endpoint.rpartition(":")
    if not sep or not _HOST.fullmatch(host):
        return "is not host:port (a DNS name, IPv4 or [IPv6] address, then :port)"
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        return "is not host:port (the port must be 1-65535)"
    return None


def kv_transfer_failed(decode_endpoint: str, details: str) -> str:
    """A prefill worker's status details when its KV stream to decode_endpoint failed: the
    decode side's own status follows. The router reads it with `kv_transfer_failed_to`."""
    return f"KV transfer to {decode_endpoint}: {details}"


def kv_transfer_failed_to(details: str, decode_endpoint: str) -> bool:
    """Whether a Prefill call's status details say its KV stream to decode_endpoint failed
    (the decode worker died or froze mid-transfer), not the prefill worker."""
    return details.startswith(kv_transfer_failed(decode_endpoint, ""))
