"""Reads the autoscaler's signals from a Prometheus server's HTTP API (instant queries over
the router's and workers' splitserve_* metrics, see splitserve_workers/metrics.py).

Series are selected by the `service` and `pool` labels the processes export and the `namespace`
label the scrape adds (the ServiceMonitor/PodMonitor the operator creates, or any
kubernetes_sd relabelling that keeps the namespace), so two LLMServices of the same name in
different namespaces never mix."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from .autoscaler import Signals

# Answers are a handful of samples; anything near this is not Prometheus.
MAX_RESPONSE_BYTES = 4 << 20


class MetricsError(RuntimeError):
    """Prometheus could not answer (unreachable, error status, not Prometheus)."""


def _window(seconds: float) -> str:
    return f"{max(1, math.ceil(seconds))}s"


class PrometheusReader:
    def __init__(self, url: str, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's vector; MetricsError says what went wrong and where."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as resp:
                raw = resp.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as e:
            detail = e.read(4096).decode(errors="replace")
            try:
                detail = json.loads(detail).get("error", detail)
            except (ValueError, AttributeError):
                pass
            raise MetricsError(f"{self.url}: HTTP {e.code} for {promql!r}: {detail}") from e
        except (OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise MetricsError(f"{self.url}: cannot query Prometheus: {reason}") from e
        if len(raw) > MAX_RESPONSE_BYTES:
            raise MetricsError(f"{self.url}: answer over {MAX_RESPONSE_BYTES} bytes for {promql!r}")
        try:
            body = json.loads(raw)
            if body.get("status") != "success":
                raise MetricsError(f"{self.url}: {promql!r} failed: {body.get('error')}")
            data = body["data"]
            if data.get("resultType") != "vector":
                raise MetricsError(f"{self.url}: {promql!r} is not a vector query")
            result: list[dict[str, Any]] = data["result"]
            return result
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise MetricsError(f"{self.url}: not a Prometheus query answer: {e}") from e

    def value(self, promql: str) -> float | None:
        """The single sample's value; None when there is none or it is NaN (no data)."""
        result = self.query(promql)
        if not result:
            return None
        value = float(result[0]["value"][1])
        return None if math.isnan(value) else value

    def by_pod(self, promql: str) -> dict[str, float]:
        return {
            str(s["metric"].get("pod")): float(s["value"][1])
            for s in self.query(promql)
            if s["metric"].get("pod")
        }

    def read(
        self, namespace: str, service: str, percentile: float, window_seconds: float
    ) -> dict[str, Signals]:
        """Signals of the prefill and decode pools over the last window."""
        q = percentile / 100.0
        w = _window(window_seconds)
        sel = f'namespace="{namespace}",service="{service}"'
        router = f'{sel},pool="router"'

        def quantile(name: str) -> float | None:
            return self.value(
                f"histogram_quantile({q}, sum by (le) (rate(splitserve_{name}_bucket{{{router}}}"
                f"[{w}])))"
            )

        def total(expr: str) -> float:
            return self.value(f"sum({expr})") or 0.0

        request_rate = total(f"rate(splitserve_requests_total{{{router}}}[{w}])")
        in_flight = total(f"splitserve_router_requests_in_flight{{{router}}}")
        admission = quantile("decode_admission_seconds")
        signals: dict[str, Signals] = {}
        for pool in ("prefill", "decode"):
            ps = f'{sel},pool="{pool}"'
            # No answer at all (not a sum of zeros): no series has two samples in the window.
            # Only the pods reporting now: a pod whose scrape fails (its series go stale) is
            # taken to carry the others' average, like one not scraped yet, not counted twice.
            busy = self.value(
                f"sum(rate(splitserve_busy_seconds_total{{{ps}}}[{w}]) "
                f"and on(pod) splitserve_requests_running{{{ps}}})"
            )
            common: dict[str, Any] = dict(
                reporting=int(self.value(f"count(splitserve_requests_running{{{ps}}})") or 0),
                busy_series=int(self.value(f"count(splitserve_busy_seconds_total{{{ps}}})") or 0),
                busy=busy or 0.0,
                busy_rated=busy is not None,
                running=total(f"splitserve_requests_running{{{ps}}}"),
                mean_running=total(
                    f"avg_over_time(sum(splitserve_requests_running{{{ps}}})[{w}:])"
                ),
                waiting=total(f"splitserve_requests_waiting{{{ps}}}"),
                request_rate=request_rate,
                in_flight=in_flight,
                decode_admission=admission,
            )
            if pool == "prefill":
                signals[pool] = Signals(
                    latency=quantile("time_to_first_token_seconds"),
                    prefill_queue=quantile("prefill_queue_seconds"),
                    **common,
                )
            else:
                signals[pool] = Signals(
                    latency=quantile("time_per_output_token_seconds"),
                    kv_usage=self.value(f"avg(splitserve_kv_cache_usage_ratio{{{ps}}})"),
                    **common,
                )
        return signals

    def pod_load(self, namespace: str, service: str, pool: str) -> dict[str, float]:
        """Sequences each pod of a pool holds now (running + waiting), by pod name."""
        ps = f'namespace="{namespace}",service="{service}",pool="{pool}"'
        return self.by_pod(
            f"sum by (pod) (splitserve_requests_running{{{ps}}}) + "
            f"sum by (pod) (splitserve_requests_waiting{{{ps}}})"
        )
