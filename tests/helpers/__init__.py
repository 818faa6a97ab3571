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
"""
