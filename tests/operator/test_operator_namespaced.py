"""The chart's default mode on the real control plane: an operator watching only its release
namespace with namespaced Roles (no cluster-wide access to LLMServices or children), and kopf
peering between two replicas: the one of lower priority pauses."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from operator_process import (
    REPO_ROOT,
    OperatorProcess,
    get_json,
    install_chart,
    is_ready,
    wait_until,
)

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def release_namespace(control_plane: Any) -> Iterator[tuple[str, str]]:
    namespace = control_plane.create_namespace(f"team-{uuid.uuid4().hex[:6]}")
    sa = install_chart(control_plane, "teamops", namespace)  # defaults: this namespace only
    try:
        yield namespace, sa
    finally:
        control_plane.kubectl("delete", "llmservices", "--all", "-n", namespace, "--wait=true",
                              check=False)  # fmt: skip
        control_plane.helm("uninstall", "teamops", "-n", namespace, check=False)
        control_plane.delete_namespace(namespace)


def operator(cp: Any, namespace: str, sa: str, priority: int, *extra: str) -> OperatorProcess:
    log = Path(cp.workdir) / "logs" / f"operator-{namespace}-{priority}.log"
    kubeconfig = cp.kubeconfig_for_service_account(namespace, sa)
    args = [f"--namespace={namespace}", "--peering=splitserve", f"--priority={priority}", *extra]
    return OperatorProcess(kubeconfig, args, log).start()


def test_namespaced_roles_suffice_and_peers_do_not_both_act(
    control_plane: Any, release_namespace: tuple[str, str]
) -> None:
    cp = control_plane
    namespace, sa = release_namespace
    # The release's ServiceAccount may not even read LLMServices elsewhere.
    can = cp.kubectl("auth", "can-i", "list", "llmservices.splitserve.io", "-A",
                     f"--as=system:serviceaccount:{namespace}:{sa}", check=False)  # fmt: skip
    assert can.stdout.strip() == "no"
    leader = operator(cp, namespace, sa, priority=200)
    standby = operator(cp, namespace, sa, priority=100)
    try:
        # Both record themselves in the chart's KopfPeering; the standby starts paused and,
        # seeing a live peer of higher priority, stays paused.
        def peers() -> int:
            obj = get_json(cp, "-n", namespace, "kopfpeering", "splitserve") or {}
            return len(obj.get("status") or {})

        wait_until(lambda: peers() == 2, "both operators in the KopfPeering")
        cp.kubectl("apply", "-n", namespace, "-f",
                   str(REPO_ROOT / "manifests" / "examples" / "tiny-cpu.yaml"))  # fmt: skip
        wait_until(lambda: is_ready(get_json(cp, "-n", namespace, "llmservice", "tiny")),
                   "tiny Ready under the namespaced operator", 180)  # fmt: skip
        # The whole logs: on a loaded machine the leader's status handlers can push its
        # reconcile line out of any fixed tail.
        assert "reconcile-create" in leader.log.read_text(errors="replace")
        standby_log = standby.log.read_text(errors="replace")
        assert "reconcile-create" not in standby_log
        assert "Resuming operations" not in standby_log
    finally:
        cp.kubectl("delete", "llmservices", "--all", "-n", namespace, "--wait=true",
                   check=False)  # fmt: skip
        standby.stop()
        leader.stop()


def test_a_deleted_deployment_or_service_is_recreated_by_the_watch_not_the_resync(
    control_plane: Any, release_namespace: tuple[str, str]
) -> None:
    cp = control_plane
    namespace, sa = release_namespace
    # A resync an hour away: whatever comes back within this test, the child watch brought back.
    op = operator(cp, namespace, sa, 500, "--resync-seconds=3600")
    try:
        cp.kubectl("apply", "-n", namespace, "-f",
                   str(REPO_ROOT / "manifests" / "examples" / "tiny-cpu.yaml"))  # fmt: skip
        wait_until(lambda: is_ready(get_json(cp, "-n", namespace, "llmservice", "tiny")),
                   "tiny Ready", 180)  # fmt: skip

        def uid(kind: str, name: str) -> str | None:
            obj = get_json(cp, "-n", namespace, kind, name)
            return obj["metadata"]["uid"] if obj else None

        def repaired() -> str:
            about_tiny = "involvedObject.kind=LLMService,involvedObject.name=tiny"
            events = get_json(cp, "-n", namespace, "events", "--field-selector", about_tiny)
            return " ".join(e["message"] for e in events["items"]
                            if e["reason"] == "DriftRepaired")  # fmt: skip

        # One at a time, so each comes back through its own watch (the repair of a Deployment
        # would also recreate a Service deleted alongside it).
        for kind, name, shown in (("service", "tiny-router", "Service"),
                                  ("deployment", "tiny-decode", "Deployment")):  # fmt: skip
            before = uid(kind, name)
            assert before
            cp.kubectl("delete", "-n", namespace, kind, name, "--wait=true")
            wait_until(lambda k=kind, n=name, b=before: uid(k, n) not in (None, b),
                       f"{kind}/{name} recreated", 60)  # fmt: skip
            # Events are posted asynchronously: wait for this one too.
            wait_until(lambda s=shown, n=name: f"recreated {s} {namespace}/{n}" in repaired(),
                       f"DriftRepaired Event for {kind}/{name}", 60)  # fmt: skip
        wait_until(lambda: is_ready(get_json(cp, "-n", namespace, "llmservice", "tiny")),
                   "tiny Ready again", 180)  # fmt: skip
        # Deleting the LLMService itself (its children go with it) recreates nothing.
        cp.kubectl("delete", "-n", namespace, "llmservice", "tiny", "--wait=true")
        wait_until(lambda: uid("deployment", "tiny-decode") is None, "children collected", 60)
        time.sleep(2)  # a repair would be a create right after the deletion
        assert uid("deployment", "tiny-decode") is None and uid("service", "tiny-router") is None
    finally:
        cp.kubectl("delete", "llmservices", "--all", "-n", namespace, "--wait=true",
                   check=False)  # fmt: skip
        op.stop()


def test_a_missing_peering_object_is_named_at_startup(
    control_plane: Any, release_namespace: tuple[str, str]
) -> None:
    # kopf itself waits for the object silently: without this line, an operator started by
    # hand against a namespace without the chart handles nothing and logs nothing.
    cp = control_plane
    namespace, sa = release_namespace
    log = Path(cp.workdir) / "logs" / f"operator-{namespace}-absent.log"
    kubeconfig = cp.kubeconfig_for_service_account(namespace, sa)
    args = [f"--namespace={namespace}", "--peering=absent"]
    absent = OperatorProcess(kubeconfig, args, log).start()
    try:
        assert f"peering: KopfPeering {namespace}/absent not found" in absent.tail(400)
    finally:
        absent.stop()
    present = operator(cp, namespace, sa, priority=300)
    try:
        assert "not found" not in present.tail(400)
    finally:
        present.stop()


def test_install_notes_name_the_watched_namespaces(
    control_plane: Any,
    release_namespace: tuple[str, str],  # its install brings the CRDs a dry run maps kinds to
) -> None:
    # An LLMService outside the watched namespaces gets no status and no Events at all, so the
    # notes say where to apply one and how to watch more, instead of `-n <namespace>`.
    def notes(*sets: str) -> str:
        args = [a for s in sets for a in ("--set", s)]
        out = control_plane.helm("install", "notes", str(REPO_ROOT / "charts" / "splitserve"),
                                 "-n", "ops", "--dry-run=client", *args).stdout  # fmt: skip
        return str(out).split("NOTES:", 1)[1]

    default = notes()
    assert "only in: ops." in default
    assert "kubectl apply -n ops -f manifests/examples/tiny-cpu.yaml" in default
    assert "--set 'watch.namespaces={ops,other}'" in default
    listed = notes("watch.namespaces={team-x,team-y}")
    assert "only in: team-x, team-y." in listed and "kubectl apply -n team-x " in listed
    assert "kubectl apply -n <namespace> " in notes("watch.allNamespaces=true")
