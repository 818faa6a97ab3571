"""What test modules share, in one place: a test module imports helpers from here (or its tier's
own helper modules and conftest fixtures), never from another test module
(tests/unit/test_repo_hygiene.py holds that).

- `paths`: the repository root and the test data directories.
- `state_writes`: change a ProxyState through the one updater, as the node proxy does.
- `http2_peer`: a scripted HTTP/2 peer for playbook tests of the sans-IO core.
- `tls_stdlib`: Python's own ssl contexts as the other side of a TLS test.
- `tls_key_updates`: TLS 1.3 key updates in both directions.
- `weak_keys`: CSRs with keys the CA must refuse or accept.
- `rbac_strategies`: hypothesis strategies for connections, rules and policy sets.
- `kube_files`: Kubernetes YAML for the kube/ tests' directories.
- `ads`: an ADS client stream and server for the control plane's xDS tests.
- `tls_pairs`: both ends of a TLS connection over loopback, per record layer.
- `control_plane`: the embedded control plane and a node proxy, end to end.
- `cni_plugin`: the CNI plugin against a fake API server and node agent.
- `hbone_echo`: HBONE endpoints and a client connection over loopback TCP.
- `proxy_metrics`: a node proxy's Prometheus samples.
- `ztunnel_process`: the node proxy as a child process.
- `workers`: worker processes in tests.
- `cni_fakes`: fakes for the node agent's dataplane (unit and netns tiers).
- `dedicated_mesh`, `malicious_probes`: dedicated-mode node proxies on a netns fabric, and probes.
- `shared_mode`: shared (in-pod) mode on a netns fabric.
- `waypoint_mesh`, `waypoint_routes`: a waypoint mesh on a netns fabric, and its route tests' apps.
"""
