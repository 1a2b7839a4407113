"""A KV cache sized as a share of the memory left once the weights are loaded
(EngineConfig.kv_cache_memory_fraction, `--kv-cache-memory-fraction`, an LLMService's
`kvCacheMemory: "90%"`): where the free memory is read, and how the engine sizes its blocks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from splitserve_workers.engine import EngineConfig, LLMEngine
from splitserve_workers.engine.memory import free_host_memory

GIB = 1 << 30


def meminfo_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable")


def test_host_free_memory_is_at_most_what_the_kernel_says_is_available() -> None:
    before = meminfo_available()
    free = free_host_memory()
    after = meminfo_available()
    # This machine's own numbers: MemAvailable, or a cgroup limit where one is tighter.
    assert 0 < free.bytes <= max(before, after)
    if free.source == "MemAvailable":
        assert min(before, after) * 0.9 <= free.bytes


def fake_host(
    tmp_path: Path, self_cgroup: str, files: dict[str, str], available: int = 64 * GIB
) -> tuple[str, str]:
    """/proc and /sys/fs/cgroup as a container with a memory limit sees them. Laid out in files
    because this machine's cgroups have no limit and a test cannot set one."""
    proc, fs = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(
        f"MemTotal:       {2 * available // 1024} kB\nMemAvailable:   {available // 1024} kB\n"
    )
    (proc / "self" / "cgroup").write_text(self_cgroup)
    for name, text in files.items():
        (fs / name).parent.mkdir(parents=True, exist_ok=True)
        (fs / name).write_text(text)
    return str(proc), str(fs)


def test_cgroup_v2_limit_less_its_working_set_caps_available_memory(tmp_path: Path) -> None:
    proc, fs = fake_host(
        tmp_path,
        "0::/\n",  # a cgroup namespace: the pod's cgroup is the root
        {
            "cgroup.controllers": "cpuset cpu io memory pids\n",
            "memory.max": f"{8 * GIB}\n",
            "memory.current": f"{3 * GIB}\n",
            "memory.stat": f"anon {2 * GIB}\ninactive_file {GIB}\nactive_file 0\n",
        },
    )
    free = free_host_memory(proc, fs)
    # 8 GiB limit - (3 GiB used - 1 GiB reclaimable page cache) = 6 GiB, under 64 GiB available.
    assert free.bytes == 6 * GIB
    assert "limit" in free.source


def test_cgroup_v2_the_tightest_parent_wins_and_no_limit_is_max(tmp_path: Path) -> None:
    proc, fs = fake_host(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        {
            "cgroup.controllers": "memory\n",
            "kubepods/pod1/ctr/memory.max": "max\n",
            "kubepods/pod1/ctr/memory.current": "0\n",
            "kubepods/pod1/memory.max": f"{4 * GIB}\n",
            "kubepods/pod1/memory.current": f"{GIB}\n",
            "kubepods/memory.max": f"{100 * GIB}\n",
            "kubepods/memory.current": f"{10 * GIB}\n",
        },
    )
    assert free_host_memory(proc, fs).bytes == 3 * GIB


def test_cgroup_v1_limit_and_no_limit(tmp_path: Path) -> None:
    limited = tmp_path / "limited"
    proc, fs = fake_host(
        limited,
        "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n",
        {
            "memory/docker/abc/memory.limit_in_bytes": f"{2 * GIB}\n",
            "memory/docker/abc/memory.usage_in_bytes": f"{GIB}\n",
            "memory/docker/abc/memory.stat": f"cache 0\ntotal_inactive_file {GIB // 2}\n",
            "memory/memory.limit_in_bytes": "9223372036854771712\n",  # the root: no limit
        },
    )
    assert free_host_memory(proc, fs).bytes == 2 * GIB - GIB // 2
    unlimited = tmp_path / "unlimited"
    proc, fs = fake_host(
        unlimited,
        "5:memory:/\n0::/\n",
        {"memory/memory.limit_in_bytes": "9223372036854771712\n"},
        available=5 * GIB,
    )
    assert free_host_memory(proc, fs).bytes == 5 * GIB


def test_host_path_missing_in_the_container_falls_back_to_its_mount(tmp_path: Path) -> None:
    # No cgroup namespace: /proc/self/cgroup names the host's path, which the container's
    # cgroup mount does not have; its own cgroup is the mount's root.
    proc, fs = fake_host(
        tmp_path,
        "0::/system.slice/docker-abc.scope\n",
        {
            "cgroup.controllers": "memory\n",
            "memory.max": f"{GIB}\n",
            "memory.current": "0\n",
        },
    )
    assert free_host_memory(proc, fs).bytes == GIB


def test_engine_sizes_its_kv_cache_from_the_free_memory(
    make_engine: Callable[..., LLMEngine],
) -> None:
    share = 0.001  # of this machine's free memory: a few MiB to tens of MiB
    low = free_host_memory().bytes
    engine = make_engine(kv_cache_memory_fraction=share)
    high = free_host_memory().bytes
    per_block = engine.block_size * engine.kv_bytes_per_token()
    lo, hi = sorted((low, high))
    # Measured after the weights loaded, between the two readings around the engine's start
    # (other processes on this machine move MemAvailable a little; 10% either way).
    assert int(0.9 * lo * share) // per_block <= engine.num_kv_blocks
    assert engine.num_kv_blocks <= int(1.1 * hi * share) // per_block
    assert engine.kv_cache_sizing.startswith("0.001 of ")
    assert engine.stats().free_blocks == engine.num_kv_blocks
    # num_kv_blocks still wins over any budget.
    assert make_engine(kv_cache_memory_fraction=share, num_kv_blocks=7).num_kv_blocks == 7


def test_a_share_smaller_than_one_block_is_refused_naming_the_field(
    make_engine: Callable[..., LLMEngine],
) -> None:
    with pytest.raises(ValueError, match=r"^EngineConfig.kv_cache_memory_fraction: 1e-12 of "):
        make_engine(kv_cache_memory_fraction=1e-12)


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5, float("nan")])
def test_out_of_range_shares_are_refused(share: float, tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="^EngineConfig.kv_cache_memory_fraction: "):
        EngineConfig(model=str(tiny_llama), kv_cache_memory_fraction=share).validate()
