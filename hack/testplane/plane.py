"""A real Kubernetes control plane from local binaries: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok-managed fake Nodes, on loopback and free ports.

Binaries come from build.sh (same directory); tests get a ControlPlane through tests/conftest.py,
and people get one through `python hack/testplane/plane.py up|down|env --dir DIR` (make cluster-up).
"""

from __future__ import annotations

import argparse
import atexit
import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import yaml

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build.sh"
STAGES_FILE = HERE / "kwok-stages.yaml"
STATE_FILE = "plane-state.json"
KUBE_VERSION = "v1.34.4"

# Labels the fake Nodes carry so workloads (and kwok) can select them.
NODE_LABELS = {
    "type": "kwok",
    "splitserve.io/testplane": "true",
    "nvidia.com/gpu.present": "true",
    "node.kubernetes.io/instance-type": "kwok-gpu-4",
}
NODE_CAPACITY = {"cpu": "32", "memory": "128Gi", "pods": "110", "nvidia.com/gpu": "4"}
SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.1/16"  # kwok hands out Pod IPs from here; must not overlap SERVICE_CIDR
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"


class PlaneError(RuntimeError):
    """A component failed to start or become ready; the message carries its last log lines."""


def build(env: dict[str, str] | None = None) -> Path:
    """Run build.sh (returns at once when the binaries are cached) and return the bin dir."""
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=None,  # the build's progress goes straight to the caller's stderr
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise PlaneError(f"{BUILD_SCRIPT.name} failed with exit status {proc.returncode}")
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise PlaneError(f"{BUILD_SCRIPT.name} printed no bin dir")
    return Path(lines[-1])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(
        ["openssl", *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if proc.returncode != 0:
        raise PlaneError(f"openssl {' '.join(args[:2])} failed:\n{proc.stdout}")


def make_pki(pki: Path) -> None:
    """CA, API server serving cert, admin client cert (group system:masters), SA key pair."""
    pki.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650",
        "-subj", "/CN=splitserve-testplane-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        cwd=pki,
    )  # fmt: skip
    leafs = {
        "apiserver": (
            "/CN=kube-apiserver",
            "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,"
            "DNS:kubernetes.default,DNS:kubernetes.default.svc,"
            "DNS:kubernetes.default.svc.cluster.local,IP:10.96.0.1\n"
            "extendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n",
        ),
        "admin": (
            "/O=system:masters/CN=splitserve-admin",
            "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n",
        ),
    }
    for name, (subject, ext) in leafs.items():
        (pki / f"{name}.ext").write_text(ext)
        _openssl("req", "-new", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", subject, cwd=pki)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "3650", "-extfile", f"{name}.ext",
                 "-out", f"{name}.crt", cwd=pki)  # fmt: skip
    # RSA keeps the service-account tokens RS256, which every client library verifies.
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
             "-out", "sa.key", cwd=pki)  # fmt: skip
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(path: Path, server: str, ca: Path, user: dict[str, str], name: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "testplane",
                "cluster": {"server": server, "certificate-authority-data": _b64(ca)},
            }
        ],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": "testplane", "user": name}}],
        "current-context": name,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path


def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class Component:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child if the Python process that started it dies (Linux).
    Only used where setpriv is missing: running Python between fork and exec in a process whose
    gRPC threads hold locks can kill the child before it execs (seen as a component that "exited
    at start" with an empty log)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


SETPRIV = shutil.which("setpriv")


def group_alive(pgid: int) -> bool:
    """True while a non-zombie process is in group pgid. Reparented zombies may never be
    reaped in a container whose init does not wait, so kill(pgid, 0) alone would lie."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(ChildProcessError):
        os.waitpid(-pgid, os.WNOHANG)  # reap our own children if they are in that group
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def kill_group(pgid: int, grace: float = 10.0) -> None:
    """SIGTERM a process group, then SIGKILL whatever is left after `grace` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok, started the way
    controller-runtime's envtest starts its plane, plus fake Nodes that get Pods to Running."""

    def __init__(
        self,
        bin_dir: Path | str | None = None,
        workdir: Path | str | None = None,
        nodes: int = 3,
        stages: Path | str = STAGES_FILE,
        die_with_parent: bool = True,
    ) -> None:
        if nodes < 0:
            raise ValueError(f"nodes must be >= 0, got {nodes}")
        self.bin_dir = Path(bin_dir) if bin_dir is not None else build()
        self._own_workdir = workdir is None
        self.workdir = (
            Path(tempfile.mkdtemp(prefix="splitserve-plane-")) if workdir is None else Path(workdir)
        )
        self.workdir = self.workdir.resolve()
        self.nodes = nodes
        self.stages = Path(stages)
        self.die_with_parent = die_with_parent
        self.pki = self.workdir / "pki"
        self.logs = self.workdir / "logs"
        self.kubeconfig = self.workdir / "admin.kubeconfig"
        self.server = ""
        self.ports: dict[str, int] = {}
        self.components: list[Component] = []
        self.node_names = [f"kwok-node-{i}" for i in range(nodes)]
        self._atexit_registered = False
        self._api: Any = None

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, timeout: float = 180.0) -> ControlPlane:
        """Start every component and return once the fake Nodes are Ready and schedulable."""
        for b in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"):
            if not os.access(self.bin_dir / b, os.X_OK):
                raise PlaneError(f"missing binary {self.bin_dir / b}; run hack/testplane/build.sh")
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        deadline = time.monotonic() + timeout
        for attempt in (1, 2):
            try:
                self._start_components(deadline)
                return self
            except PlaneError as e:
                # Ports are picked free before a component binds them, so another process can
                # grab one in between; and a component can die before it logs anything. Start
                # over once on fresh ports and fresh data.
                transient = "address already in use" in str(e) or "exited at start" in str(e)
                if attempt == 2 or not transient:
                    self.stop()
                    raise
                self._kill_components()
                for sub in ("etcd-data", "logs"):
                    shutil.rmtree(self.workdir / sub, ignore_errors=True)
            except BaseException:  # KeyboardInterrupt too: never leave orphans behind
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _start_components(self, deadline: float) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        make_pki(self.pki)
        self._start_etcd(deadline)
        self._start_apiserver(deadline)
        self._start_controllers(deadline)
        self._create_nodes()
        self.wait_nodes_ready(deadline - time.monotonic())
        self._wait_default_service_account("default", deadline - time.monotonic())

    def _kill_components(self) -> None:
        for comp in reversed(self.components):
            kill_group(comp.proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                comp.proc.wait(timeout=5)
        self.components.clear()
        if self._api is not None:
            with contextlib.suppress(Exception):
                self._api.close()
            self._api = None

    def stop(self) -> None:
        """Kill every component's process group (reverse start order). Safe to call twice."""
        self._kill_components()
        if self._own_workdir and not os.environ.get("SPLITSERVE_KEEP_PLANE"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def detach(self) -> Path:
        """Leave the components running after this process exits; return the state file
        that `down` (stop_detached) uses to stop them."""
        if self._atexit_registered:
            atexit.unregister(self.stop)
            self._atexit_registered = False
        state = {
            "kubeconfig": str(self.kubeconfig),
            "server": self.server,
            "bin_dir": str(self.bin_dir),
            "workdir": str(self.workdir),
            "pgids": {c.name: c.proc.pid for c in self.components},
        }
        path = self.workdir / STATE_FILE
        path.write_text(json.dumps(state, indent=2))
        self.components.clear()
        self._own_workdir = False
        return path

    # -- components ----------------------------------------------------------------------

    def _spawn(self, name: str, args: Sequence[str]) -> Component:
        log = self.logs / f"{name}.log"
        out: IO[bytes] = log.open("ab")
        argv = [str(self.bin_dir / args[0]), *args[1:]]
        preexec = None
        if self.die_with_parent and SETPRIV:
            # setpriv sets the parent-death signal and execs the component: no Python code runs
            # in the forked child.
            argv = [SETPRIV, "--pdeathsig", "TERM", "--", *argv]
        elif self.die_with_parent:
            preexec = _die_with_parent
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
            start_new_session=True,  # own process group: stop() kills it and its children
            preexec_fn=preexec,
        )
        out.close()
        comp = Component(name, proc, log)
        self.components.append(comp)
        return comp

    def _wait(self, comp: Component, ready: Callable[[], bool], deadline: float) -> None:
        while time.monotonic() < deadline:
            if comp.proc.poll() is not None:
                raise PlaneError(
                    f"{comp.name} exited at start with status {comp.proc.returncode}; "
                    f"last lines of {comp.log}:\n{tail(comp.log)}"
                )
            if ready():
                return
            time.sleep(0.2)
        raise PlaneError(
            f"{comp.name} not ready in time; last lines of {comp.log}:\n{tail(comp.log)}"
        )

    def _start_etcd(self, deadline: float) -> None:
        client, peer = free_port(), free_port()
        self.ports["etcd"] = client
        data = self.workdir / "etcd-data"
        comp = self._spawn(
            "etcd",
            [
                "etcd",
                "--name=testplane",
                f"--data-dir={data}",
                f"--listen-client-urls=http://127.0.0.1:{client}",
                f"--advertise-client-urls=http://127.0.0.1:{client}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=testplane=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync=true",  # test data: durability buys nothing, fsync costs a lot
                "--log-level=warn",
            ],
        )
        self._wait(comp, lambda: _http_ok(f"http://127.0.0.1:{client}/health"), deadline)

    def _start_apiserver(self, deadline: float) -> None:
        port = free_port()
        self.ports["kube-apiserver"] = port
        self.server = f"https://127.0.0.1:{port}"
        p = self.pki
        comp = self._spawn(
            "kube-apiserver",
            [
                "kube-apiserver",
                f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                f"--tls-cert-file={p / 'apiserver.crt'}",
                f"--tls-private-key-file={p / 'apiserver.key'}",
                f"--client-ca-file={p / 'ca.crt'}",
                "--authorization-mode=RBAC",
                f"--service-account-issuer={SA_ISSUER}",
                f"--service-account-key-file={p / 'sa.pub'}",
                f"--service-account-signing-key-file={p / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--allow-privileged=true",
                # The default "lease" reconciler would publish 127.0.0.1 as the endpoint of the
                # `kubernetes` Service, which the API rejects; nothing in the plane needs it.
                "--endpoint-reconciler-type=none",
                "--profiling=false",
                "--v=1",
            ],
        )
        admin = {
            "client-certificate-data": _b64(p / "admin.crt"),
            "client-key-data": _b64(p / "admin.key"),
        }
        write_kubeconfig(self.kubeconfig, self.server, p / "ca.crt", admin, "admin")
        ctx = ssl.create_default_context(cafile=str(p / "ca.crt"))
        ctx.load_cert_chain(str(p / "admin.crt"), str(p / "admin.key"))
        self._wait(comp, lambda: _http_ok(f"{self.server}/readyz", ctx), deadline)

    def _start_controllers(self, deadline: float) -> None:
        kc = str(self.kubeconfig)
        auth = [f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}", "--bind-address=127.0.0.1"]  # fmt: skip
        cm_port, sched_port = free_port(), free_port()
        self.ports["kube-controller-manager"] = cm_port
        self.ports["kube-scheduler"] = sched_port
        cm = self._spawn(
            "kube-controller-manager",
            [
                "kube-controller-manager",
                *auth,
                f"--secure-port={cm_port}",
                f"--cert-dir={self.workdir / 'controller-manager-certs'}",
                "--leader-elect=false",
                # Without these two the serviceaccount-token controller cannot mint the
                # kube-root-ca.crt ConfigMaps and tokens that ServiceAccount admission expects.
                f"--service-account-private-key-file={self.pki / 'sa.key'}",
                f"--root-ca-file={self.pki / 'ca.crt'}",
                f"--cluster-signing-cert-file={self.pki / 'ca.crt'}",
                f"--cluster-signing-key-file={self.pki / 'ca.key'}",
                "--controllers=*",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--v=1",
            ],
        )
        sched = self._spawn(
            "kube-scheduler",
            [
                "kube-scheduler",
                *auth,
                f"--secure-port={sched_port}",
                f"--cert-dir={self.workdir / 'scheduler-certs'}",
                "--leader-elect=false",
                "--v=1",
            ],
        )
        kwok = self._spawn(
            "kwok",
            [
                "kwok",
                f"--kubeconfig={kc}",
                f"--config={self.stages}",
                "--manage-all-nodes=false",
                "--manage-nodes-with-label-selector=type=kwok",
                f"--cidr={POD_CIDR}",
                "--node-ip=10.240.0.1",
            ],
        )
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE  # self-signed serving certs on loopback
        self._wait(cm, lambda: _http_ok(f"https://127.0.0.1:{cm_port}/healthz", insecure), deadline)
        self._wait(
            sched, lambda: _http_ok(f"https://127.0.0.1:{sched_port}/healthz", insecure), deadline
        )
        if kwok.proc.poll() is not None:
            raise PlaneError(
                f"kwok exited at start with status {kwok.proc.returncode}; "
                f"last lines of {kwok.log}:\n{tail(kwok.log)}"
            )

    def _create_nodes(self) -> None:
        for name in self.node_names:
            self.create_node(name)

    def create_node(
        self,
        name: str,
        pod_cidr: str | None = None,
        labels: dict[str, str] | None = None,
        taints: list[dict[str, str]] | None = None,
    ) -> None:
        """A kwok-managed fake Node. pod_cidr: where kwok takes its pods' IPs from (instead of
        POD_CIDR); a loopback range gives pods addresses a test process can listen on."""
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {**NODE_LABELS, "kubernetes.io/hostname": name, **(labels or {})},
                "annotations": {"kwok.x-k8s.io/node": "fake"},
            },
            "spec": {"taints": taints or []},
            # Nodes accept status on create; kwok's node-initialize stage keeps it.
            "status": {"capacity": NODE_CAPACITY, "allocatable": NODE_CAPACITY},
        }
        if pod_cidr:
            body["spec"]["podCIDR"] = pod_cidr
            body["spec"]["podCIDRs"] = [pod_cidr]
        self.core_v1().create_node(body)

    # -- waiting -------------------------------------------------------------------------

    def nodes_ready(self) -> bool:
        bad_taints = {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}
        items = self.core_v1().list_node(label_selector="type=kwok").items
        ready = 0
        for node in items:
            conds = {c.type: c.status for c in (node.status.conditions or [])}
            taints = {t.key for t in (node.spec.taints or [])}
            if conds.get("Ready") == "True" and not taints & bad_taints:
                ready += 1
        return ready >= self.nodes

    def wait_nodes_ready(self, timeout: float = 60.0) -> None:
        kwok = next((c for c in self.components if c.name == "kwok"), None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if kwok is not None and kwok.proc.poll() is not None:
                raise PlaneError(f"kwok exited; last lines of {kwok.log}:\n{tail(kwok.log)}")
            if self.nodes_ready():
                return
            time.sleep(0.3)
        log = kwok.log if kwok else self.logs / "kwok.log"
        raise PlaneError(f"fake Nodes not Ready in {timeout:.0f}s; kwok log:\n{tail(log)}")

    def _wait_default_service_account(self, namespace: str, timeout: float) -> None:
        # Pods are rejected by ServiceAccount admission until the controller creates "default".
        core = self.core_v1()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if core.list_namespaced_service_account(
                namespace, field_selector="metadata.name=default"
            ).items:
                return
            time.sleep(0.2)
        raise PlaneError(f"ServiceAccount {namespace}/default was not created in time")

    # -- clients -------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        # helm keeps caches and repo config under these; keep them inside the plane's dir.
        for var, sub in (("HELM_CACHE_HOME", "cache"), ("HELM_CONFIG_HOME", "config"),
                         ("HELM_DATA_HOME", "data")):  # fmt: skip
            env.setdefault(var, str(self.workdir / "helm" / sub))
        return env

    def _run(
        self, binary: str, args: Sequence[str], input: str | None, check: bool, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bin_dir / binary), *args]
        proc = subprocess.run(
            cmd, input=input, capture_output=True, text=True, env=self._env(), timeout=timeout
        )
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(
                proc.returncode, [binary, *args], output=proc.stdout, stderr=proc.stderr
            )
        return proc

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        return self._run(
            "kubectl", [f"--kubeconfig={self.kubeconfig}", *args], input, check, timeout
        )

    def helm(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 300.0
    ) -> subprocess.CompletedProcess[str]:
        return self._run("helm", [f"--kubeconfig={self.kubeconfig}", *args], input, check, timeout)

    def api_client(self) -> Any:
        """A new kubernetes.client.ApiClient authenticated as the admin (system:masters)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def core_v1(self) -> Any:
        from kubernetes import client

        if self._api is None:
            self._api = self.api_client()
        return client.CoreV1Api(self._api)

    def create_namespace(self, name: str, timeout: float = 30.0) -> str:
        """Create a namespace and wait until Pods can be admitted there (default SA exists)."""
        self.core_v1().create_namespace({"metadata": {"name": name}})
        self._wait_default_service_account(name, timeout)
        return name

    def delete_namespace(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.core_v1().delete_namespace(name)
        except ApiException as e:
            if e.status != 404:
                raise

    def kubeconfig_for_service_account(
        self, namespace: str, name: str, expiration_seconds: int = 3600
    ) -> Path:
        """Kubeconfig with a real bound token for namespace/name from the TokenRequest API."""
        resp = self.core_v1().create_namespaced_service_account_token(
            name, namespace, {"spec": {"expirationSeconds": expiration_seconds}}
        )
        token = resp.status.token
        path = self.workdir / "sa-kubeconfigs" / f"{namespace}.{name}.kubeconfig"
        path.parent.mkdir(parents=True, exist_ok=True)
        user = f"system:serviceaccount:{namespace}:{name}"
        return write_kubeconfig(path, self.server, self.pki / "ca.crt", {"token": token}, user)


# -- detached mode (make cluster-up / cluster-down) ----------------------------------------


def up(directory: Path, nodes: int) -> Path:
    state = directory / STATE_FILE
    if state.exists():
        raise PlaneError(f"{state} exists: run `down --dir {directory}` first")
    directory.mkdir(parents=True, exist_ok=True)
    # Every `up` is a fresh cluster: etcd data left by an earlier plane (a `down` before this
    # one removed it; a killed `up` may not have) would bring back its objects and Nodes.
    _remove_data(directory)
    plane = ControlPlane(workdir=directory, nodes=nodes, die_with_parent=False)
    plane.start()
    return plane.detach()


def down(directory: Path) -> bool:
    """Stop a detached plane; True if one was running."""
    state_path = directory / STATE_FILE
    if not state_path.exists():
        return False
    state = json.loads(state_path.read_text())
    for pgid in reversed(list(state["pgids"].values())):
        kill_group(int(pgid))
    state_path.unlink()
    _remove_data(directory)
    return True


def _remove_data(directory: Path) -> None:
    """The cluster's state (etcd's data); logs stay for a look after `down`."""
    shutil.rmtree(directory / "etcd-data", ignore_errors=True)


def env_lines(directory: Path) -> list[str]:
    state_path = directory / STATE_FILE
    if not state_path.exists():
        raise PlaneError(f"no plane running in {directory} (no {STATE_FILE}); run `up` first")
    state = json.loads(state_path.read_text())
    return [
        f"export KUBECONFIG={state['kubeconfig']}",
        f"export PATH={state['bin_dir']}:$PATH",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("command", choices=["up", "down", "env"])
    parser.add_argument("--dir", type=Path, default=Path(".cluster"), help="state directory")
    parser.add_argument("--nodes", type=int, default=3, help="number of fake Nodes (up)")
    args = parser.parse_args(argv)
    directory: Path = args.dir.resolve()
    try:
        if args.command == "up":
            started = time.monotonic()
            up(directory, args.nodes)
            print(f"control plane up in {time.monotonic() - started:.1f}s; state in {directory}")
            print("\n".join(env_lines(directory)))
        elif args.command == "down":
            print("stopped" if down(directory) else f"no plane running in {directory}")
        else:
            print("\n".join(env_lines(directory)))
    except PlaneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
