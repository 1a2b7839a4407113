"""Mode HPA on the real control plane: `kubectl scale --replicas=0` pauses a pool's HPA, and only
the edit that enters mode HPA wakes a pool at zero. An operator restart, a label on the
LLMService or an unrelated spec edit must leave the pause alone."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
from operator_process import OperatorProcess, get_json, wait_until
from test_operator_cluster import apply, deployment, tiny, wait_ready

pytestmark = pytest.mark.cluster


def decode_replicas(cp: Any, namespace: str) -> int:
    return int(deployment(cp, namespace, "tiny-decode")["spec"]["replicas"])  # type: ignore[index]


def stays_paused(cp: Any, namespace: str, what: str, seconds: float = 8.0) -> None:
    """Several resyncs (every 2 s here) and the handlers of `what` have run by then."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert decode_replicas(cp, namespace) == 0, f"the pause was undone by {what}"
        time.sleep(0.5)


def test_a_paused_hpa_pool_stays_paused(
    control_plane: Any, operator: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    obj = tiny(autoscaling={"mode": "HPA"})
    for pool in ("prefill", "decode"):
        obj["spec"][pool]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 4}
    obj["spec"]["decode"]["replicas"] = 2
    apply(cp, namespace, obj)
    wait_ready(cp, namespace, "tiny")
    cp.kubectl("scale", "-n", namespace, "deployment/tiny-decode", "--replicas=0")
    stays_paused(cp, namespace, "a resync")

    cp.kubectl("label", "-n", namespace, "llmservice/tiny", "team=chat")
    stays_paused(cp, namespace, "a label on the LLMService")

    obj["spec"]["slo"]["ttft"] = "3s"
    apply(cp, namespace, obj)
    wait_until(
        lambda: (
            (o := get_llms(cp, namespace))
            and o["metadata"]["generation"] == 2
            and o["status"].get("observedGeneration") == 2
        ),
        "the SLO edit handled",
    )
    stays_paused(cp, namespace, "an SLO edit")

    operator.stop(signal.SIGKILL)
    operator.start()
    stays_paused(cp, namespace, "an operator restart")

    # Entering mode HPA still wakes a pool at zero (an HPA never scales up from zero): KEDA
    # left it there (no KEDA runs here; the operator leaves KEDA's pools' replicas alone).
    set_mode(cp, namespace, obj, "KEDA")
    cp.kubectl("scale", "-n", namespace, "deployment/tiny-decode", "--replicas=0")
    stays_paused(cp, namespace, "mode KEDA", seconds=3)
    set_mode(cp, namespace, obj, "HPA")
    wait_until(lambda: decode_replicas(cp, namespace) == 2, "entering mode HPA wakes decode")


def set_mode(cp: Any, namespace: str, obj: dict[str, Any], mode: str) -> None:
    obj["spec"]["autoscaling"] = {"mode": mode}
    apply(cp, namespace, obj)
    wait_until(
        lambda: (
            (o := get_llms(cp, namespace))
            and o["status"].get("observedGeneration") == o["metadata"]["generation"]
        ),
        f"mode {mode} handled",
    )


def get_llms(cp: Any, namespace: str) -> dict[str, Any] | None:
    return get_json(cp, "-n", namespace, "llmservice", "tiny")  # type: ignore[no-any-return]
