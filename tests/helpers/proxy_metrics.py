"""A node proxy's Prometheus samples, by metric name."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(proxy, name: str) -> list[tuple[dict, float]]:
    text = proxy.metrics.render()[0].decode()
    out = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out.append((dict(sample.labels), sample.value))
    return out
