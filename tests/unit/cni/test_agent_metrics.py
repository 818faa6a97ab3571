"""The node agent's /metrics carry istio-cni's series and nothing prometheus-client adds."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from ambient_mesh.cni.agent import AgentMetrics


def test_agent_metrics_have_no_created_series():
    metrics = AgentMetrics()
    metrics.installs.labels("SUCCESS").inc()
    metrics.plugin_requests.labels("200").inc()
    metrics.reconcile_events.labels("add").inc(2)
    metrics.install_ready.set(1)
    text = metrics.render().decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert not [name for name in samples if name.endswith("_created")], text
    assert samples["istio_cni_installs_total"] == 1
    assert samples["nodeagent_reconcile_events_total"] == 2
    assert samples["istio_cni_install_ready"] == 1
