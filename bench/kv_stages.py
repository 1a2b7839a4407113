"""Where the time of one small KV transfer goes (not a test): the 1 MB row of kv_transfer.py
split into stages, next to the plain socket sending the same bytes in the same run.

Same receiver process, same KVSender and DecodeRole.PushKV as bench/kv_transfer.py; a payload
that fits in one KV message (1 MB of an 8B-shaped model by default: 8 tokens x 32 layers), so
each stage has one start and one end. Both processes stamp with time.monotonic()
(CLOCK_MONOTONIC, one clock for the whole machine):

  handover   first on_kv -> the last on_kv returns (the engine thread: 32 slices queued)
  dequeue    -> gRPC's request-iterator thread takes the sealed batch (a thread wake-up)
  transport  -> decode's PushKV deserializer has the whole message (encode, HTTP/2 write,
                receive, reassembly, hand-off to the event loop)
  handle     -> the import into the cache returned (parse, validation, copy)
  ack        -> the sender's done callback (response, trailers, client completion queue)
  wake       -> the thread that waits for the transfer has it

`gRPC only` is dequeue + transport + ack + wake: the hand-offs and the wire, none of our
parsing, validation or copies (encode's one copy excepted). Its ratio to the socket is the
ceiling our own code could reach on this machine if handover and handle cost nothing.

    python bench/kv_stages.py [--payload-kb 1024] [--repeats 200]  # bench/results/kv_stages.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_transfer as kt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "kv_stages.json"
STAGES = ("handover", "dequeue", "transport", "handle", "ack", "wake")
GRPC_ONLY = ("dequeue", "transport", "ack", "wake")


def stages(t0: float, sender: Any, receiver: dict[str, float], done: float) -> dict[str, float]:
    result = sender.future.result()
    marks = [
        t0, sender.last_kv_at, result.first_send, receiver["arrived"], receiver["imported"],
        result.acked, done,
    ]  # fmt: skip
    return {name: b - a for name, a, b in zip(STAGES, marks[:-1], marks[1:], strict=True)}


def run(payload_kb: int, repeats: int, warmup: int) -> dict[str, Any]:
    import grpc
    from splitserve_workers.kv_transfer import DEFAULT_CHUNK_BYTES, ChannelPool
    from splitserve_workers.proto import serving_pb2_grpc as pbg

    n_tokens = max(1, (payload_kb << 10) // kt.BYTES_PER_TOKEN)
    payload = n_tokens * kt.BYTES_PER_TOKEN
    if payload > DEFAULT_CHUNK_BYTES:
        raise SystemExit(
            f"--payload-kb: {payload} bytes need more than one {DEFAULT_CHUNK_BYTES}-byte KV "
            "message; stages overlap then (use bench/kv_transfer.py)"
        )
    proc, endpoint, sock = kt.start_receiver(max(1, payload >> 20) + 1, stamps=True)
    channel = grpc.insecure_channel(endpoint)
    stub = pbg.DecodeServiceStub(channel)
    take = channel.unary_unary("/bench.Sink/Stamps")
    pool = ChannelPool()
    k = torch.randn(n_tokens, kt.HEADS, kt.HEAD_DIM).to(torch.bfloat16)
    v = torch.randn(n_tokens, kt.HEADS, kt.HEAD_DIM).to(torch.bfloat16)
    per_stage: dict[str, list[float]] = {name: [] for name in STAGES}
    totals, sockets = [], []
    try:
        for r in range(warmup + repeats):
            # Alternate with the socket, as kv_transfer.py does, so load drift hits both alike.
            rid = f"stages-{r}"
            t0, sender, done = kt.timed_grpc_transfer(
                stub, pool, endpoint, rid, n_tokens, k, v, DEFAULT_CHUNK_BYTES
            )
            s = kt.socket_transfer(sock, k, v)
            receiver = json.loads(take(rid.encode()))
            if r < warmup:
                continue
            for name, seconds in stages(t0, sender, receiver, done).items():
                per_stage[name].append(seconds)
            totals.append(done - t0)
            sockets.append(s)
    finally:
        sock.close()
        pool.close()
        channel.close()
        proc.kill()
    med = {name: statistics.median(xs) for name, xs in per_stage.items()}
    grpc_only = [sum(per_stage[n][i] for n in GRPC_ONLY) for i in range(repeats)]
    total, sock_s, floor = (statistics.median(x) for x in (totals, sockets, grpc_only))
    return {
        "payload_bytes": payload,
        "repeats": repeats,
        "stage_seconds": med,  # per-stage medians (they need not add up to the total's)
        "total_seconds": total,
        "grpc_only_seconds": floor,
        "socket_seconds": sock_s,
        "ratio": sock_s / total,
        "grpc_only_ratio": sock_s / floor,
    }


def report(r: dict[str, Any]) -> None:
    print(f"{r['payload_bytes'] / 1e6:.2f} MB in one KV message, median of {r['repeats']}")
    for name in STAGES:
        us = r["stage_seconds"][name] * 1e6
        tag = "  (gRPC)" if name in GRPC_ONLY else ""
        print(f"  {name:>10} {us:8.0f} us{tag}")
    print(f"  {'total':>10} {r['total_seconds'] * 1e6:8.0f} us   socket "
          f"{r['socket_seconds'] * 1e6:.0f} us   ratio {r['ratio']:.2f}")  # fmt: skip
    print(f"  {'gRPC only':>10} {r['grpc_only_seconds'] * 1e6:8.0f} us   ratio if our own stages "
          f"cost nothing {r['grpc_only_ratio']:.2f}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--payload-kb", type=int, default=1024, help="KV payload (KiB), one message")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.payload_kb < 1 or args.repeats < 1 or args.warmup < 0:
        ap.error("--payload-kb and --repeats must be >= 1, --warmup >= 0")
    torch.set_num_threads(1)
    result = run(args.payload_kb, args.repeats, args.warmup)
    report(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
