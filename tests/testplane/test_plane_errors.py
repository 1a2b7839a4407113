"""ControlPlane failure paths without the real binaries: a component that dies at start is
reported with its log lines and nothing is left running (hack/testplane/plane.py)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import plane
import pytest

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


def fake_bin_dir(tmp_path: Path, etcd_script: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in COMPONENTS:
        script = etcd_script if name == "etcd" else "#!/bin/sh\nexit 3\n"
        path = bin_dir / name
        path.write_text(script)
        path.chmod(0o755)
    return bin_dir


def test_dying_component_is_reported_with_its_log(tmp_path: Path) -> None:
    bin_dir = fake_bin_dir(tmp_path, "#!/bin/sh\necho 'etcd: bad flag --frobnicate' >&2\nexit 2\n")
    cp = plane.ControlPlane(bin_dir=bin_dir, workdir=tmp_path / "work")
    with pytest.raises(plane.PlaneError) as err:
        cp.start(timeout=30)
    assert "etcd exited at start with status 2" in str(err.value)
    assert "bad flag --frobnicate" in str(err.value)
    assert cp.components == []


def test_component_that_never_gets_ready_is_killed(tmp_path: Path) -> None:
    # Writes its pid, then sleeps without ever serving /health.
    pidfile = tmp_path / "etcd.pid"
    bin_dir = fake_bin_dir(tmp_path, f"#!/bin/sh\necho $$ > {pidfile}\nexec sleep 600\n")
    cp = plane.ControlPlane(bin_dir=bin_dir, workdir=tmp_path / "work")
    with pytest.raises(plane.PlaneError, match="etcd not ready in time"):
        cp.start(timeout=3)
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 60  # bounds a hang; the kill is immediate
    while time.monotonic() < deadline and plane.group_alive(pid):
        time.sleep(0.1)
    assert not plane.group_alive(pid), "stop() must kill the component's process group"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_missing_binary_is_named(tmp_path: Path) -> None:
    cp = plane.ControlPlane(bin_dir=tmp_path, workdir=tmp_path / "work")
    with pytest.raises(plane.PlaneError, match="missing binary .*etcd"):
        cp.start()


def test_negative_node_count_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nodes must be >= 0"):
        plane.ControlPlane(bin_dir=tmp_path, nodes=-1)


@pytest.mark.parametrize(
    "first_run",
    [
        'sys.exit("listen tcp 127.0.0.1:1234: bind: address already in use")',
        "os._exit(1)  # dies before it logs a line",
    ],
    ids=["port-taken", "silent-exit"],
)
def test_component_dying_at_start_is_retried_once(tmp_path: Path, first_run: str) -> None:
    # First run: fails (its port was taken, or it dies silently). Second run: serves /health
    # on the given port.
    runs = tmp_path / "etcd-runs"
    etcd = f"""#!{sys.executable}
import http.server, os, sys
from pathlib import Path
runs = Path({str(runs)!r})
runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
if len(runs.read_text()) == 1:
    {first_run}
url = next(a for a in sys.argv if a.startswith("--listen-client-urls="))
port = int(url.rsplit(":", 1)[1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{{"health":"true"}}')
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""
    bin_dir = fake_bin_dir(tmp_path, etcd)
    cp = plane.ControlPlane(bin_dir=bin_dir, workdir=tmp_path / "work")
    with pytest.raises(plane.PlaneError, match="kube-apiserver exited at start with status 3"):
        cp.start(timeout=30)
    assert runs.read_text() == "xx", "etcd is started again after its first start failed"
    assert cp.components == []
