"""What both ends of a gRPC call agree on beyond the messages in protos/: kept in one place so
the side that writes it and the side that reads it cannot drift apart. Imports nothing heavy
(the router uses it)."""

from __future__ import annotations


def kv_transfer_failed(decode_endpoint: str, details: str) -> str:
    """A prefill worker's status details when its KV stream to decode_endpoint failed: the
    decode side's own status follows. The router reads it with `kv_transfer_failed_to`."""
    return f"KV transfer to {decode_endpoint}: {details}"


def kv_transfer_failed_to(details: str, decode_endpoint: str) -> bool:
    """Whether a Prefill call's status details say its KV stream to decode_endpoint failed
    (the decode worker died or froze mid-transfer), not the prefill worker."""
    return details.startswith(kv_transfer_failed(decode_endpoint, ""))
