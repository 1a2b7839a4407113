"""FileDiscovery (router/discovery.py): the workers file local mode's autoscaler rewrites is
re-read when it changes, and a bad rewrite keeps the last good list instead of emptying a pool."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from splitserve_workers.router.discovery import FileDiscovery


def write(path: Path, data: object) -> None:
    # The way local mode writes it: a new file renamed over the old one.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data) if not isinstance(data, str) else data)
    os.replace(tmp, path)


async def test_rewrites_are_picked_up(tmp_path: Path) -> None:
    path = tmp_path / "workers.json"
    write(path, {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"]})
    discovery = FileDiscovery(str(path))
    assert discovery.roles() == ["prefill", "decode"]
    assert await discovery.endpoints("decode") == ["127.0.0.1:2"]
    write(path, {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2", "127.0.0.1:3"]})
    assert await discovery.endpoints("decode") == ["127.0.0.1:2", "127.0.0.1:3"]
    write(path, {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:3"]})
    assert await discovery.endpoints("decode") == ["127.0.0.1:3"]
    assert await discovery.endpoints("colocated") == []


@pytest.mark.parametrize(
    "bad",
    [
        "{truncated",
        {"prefill": ["127.0.0.1:1"], "decode": ["nope"]},
        {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"], "colocated": ["127.0.0.1:9"]},
    ],
    ids=["not-json", "bad-endpoint", "new-role"],
)
async def test_bad_rewrite_keeps_the_last_good_list(
    tmp_path: Path, bad: object, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "workers.json"
    write(path, {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"]})
    discovery = FileDiscovery(str(path))
    write(path, bad)
    assert await discovery.endpoints("decode") == ["127.0.0.1:2"]
    assert await discovery.endpoints("prefill") == ["127.0.0.1:1"]
    assert "keeping the last good worker list" in caplog.text
    assert len([r for r in caplog.records if "keeping" in r.getMessage()]) == 1, "said once"
    write(path, {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:4"]})
    assert await discovery.endpoints("decode") == ["127.0.0.1:4"]


async def test_removed_file_keeps_the_last_good_list(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "workers.json"
    write(path, {"colocated": ["127.0.0.1:5"]})
    discovery = FileDiscovery(str(path))
    path.unlink()
    assert await discovery.endpoints("colocated") == ["127.0.0.1:5"]
    assert await discovery.endpoints("colocated") == ["127.0.0.1:5"]
    assert discovery.roles() == ["colocated"]
    warnings = [r.getMessage() for r in caplog.records if "keeping" in r.getMessage()]
    assert len(warnings) == 1 and "No such file" in warnings[0]


async def test_the_roles_are_the_first_reads(tmp_path: Path) -> None:
    path = tmp_path / "workers.json"
    write(path, {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"]})
    discovery = FileDiscovery(str(path))
    # A rewrite without decode empties that pool; it does not drop the role.
    write(path, {"prefill": ["127.0.0.1:1"]})
    assert await discovery.endpoints("decode") == []
    assert discovery.roles() == ["prefill", "decode"]
    write(path, {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:3"]})
    assert await discovery.endpoints("decode") == ["127.0.0.1:3"]
