"""Memory an engine may still take, for a KV cache sized as a share of it
(EngineConfig.kv_cache_memory_fraction).

Measured once the weights are loaded, so the share is of what is left after them:
- CUDA: the driver's free memory on the engine's GPU (what other processes hold is not free).
- CPU: the kernel's MemAvailable, capped by the process's cgroup memory limit less the cgroup's
  working set (usage minus inactive page cache, which is how the kubelet counts a pod's memory
  before it evicts or the kernel OOM-kills it). cgroup v2 and v1 are both read; the tightest of
  the process's cgroup and its parents wins, so a pod limit applies inside a container whose
  own cgroup has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# cgroup v1 reports "no limit" as a page-rounded 2**63 - 1; anything this large is no limit.
_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class FreeMemory:
    bytes: int
    source: str  # where the number comes from, for the worker's start-up log


def free_memory(device: Any) -> FreeMemory:
    """What the engine on `device` (a torch.device) may still allocate."""
    if device.type == "cuda":
        import torch

        # Blocks torch's allocator cached while loading are free for the cache too.
        torch.cuda.empty_cache()
        free, _total = torch.cuda.mem_get_info(device)
        return FreeMemory(int(free), f"free memory on {device}")
    return free_host_memory()


def free_host_memory(proc: str = "/proc", cgroup_fs: str = "/sys/fs/cgroup") -> FreeMemory:
    """MemAvailable, or a cgroup's headroom where that is smaller. The paths are parameters so
    tests can lay out a cgroup limit, which this machine cannot set for real."""
    best = FreeMemory(_meminfo_available(Path(proc) / "meminfo"), "MemAvailable")
    for directory, limit, working_set in _cgroup_limits(Path(proc) / "self" / "cgroup", cgroup_fs):
        headroom = max(0, limit - working_set)
        if headroom < best.bytes:
            best = FreeMemory(
                headroom, f"cgroup {directory}: limit {limit} less working set {working_set}"
            )
    return best


def _meminfo_available(path: Path) -> int:
    for line in path.read_text().splitlines():
        name, _, rest = line.partition(":")
        if name == "MemAvailable":
            return int(rest.split()[0]) * 1024  # kB
    raise OSError(f"{path} has no MemAvailable line")


def _read_text(path: Path) -> str:
    """A cgroup file's text; "" where it does not exist (a controller or level not there)."""
    try:
        return path.read_text()
    except OSError:
        return ""


def _read_int(path: Path) -> int | None:
    """A cgroup file's number; None for a missing file or "max" (no limit)."""
    text = _read_text(path).strip()
    return None if text in ("", "max") else int(text)


def _stat(path: Path, key: str) -> int:
    for line in _read_text(path).splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def _chain(root: Path, relative: str) -> list[Path]:
    """The cgroup directory of `relative` under `root` and each parent up to `root`. Without a
    cgroup namespace a container sees its host path in /proc/self/cgroup but has its own
    cgroup mounted at the root: a path that does not exist falls back to the root."""
    here = root / relative.lstrip("/")
    if not here.is_dir():
        return [root] if root.is_dir() else []
    chain = [here]
    while chain[-1] != root and root in chain[-1].parents:
        chain.append(chain[-1].parent)
    return chain


def _cgroup_limits(self_cgroup: Path, cgroup_fs: str) -> list[tuple[str, int, int]]:
    """(directory, limit, working set) for every memory-limited cgroup above this process."""
    lines = _read_text(self_cgroup).splitlines()
    fs = Path(cgroup_fs)
    found = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, relative = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2 (unified); memory only if enabled there
            if "memory" not in _read_text(fs / "cgroup.controllers").split():
                continue
            for d in _chain(fs, relative):
                limit = _read_int(d / "memory.max")
                if limit is not None and limit < _UNLIMITED:
                    usage = _read_int(d / "memory.current") or 0
                    inactive = _stat(d / "memory.stat", "inactive_file")
                    found.append((str(d), limit, max(0, usage - inactive)))
        elif "memory" in controllers.split(","):  # v1
            for d in _chain(fs / "memory", relative):
                limit = _read_int(d / "memory.limit_in_bytes")
                if limit is not None and limit < _UNLIMITED:
                    usage = _read_int(d / "memory.usage_in_bytes") or 0
                    inactive = _stat(d / "memory.stat", "total_inactive_file")
                    found.append((str(d), limit, max(0, usage - inactive)))
    return found
