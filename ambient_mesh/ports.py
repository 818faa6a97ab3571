"""The well-known ports of Istio's ambient data plane, defined once.

Counterparts: ztunnel's listener defaults (src/config.rs), istio-cni's redirection targets
(cni/pkg/iptables) and istiod's `HBONE_MTLS_PORT`; docs/istio-behaviour.md, "Ports", lists
them. Rules, listeners, routing and the lab take them from here.
"""

OUTBOUND_PORT = 15001  # captured outbound traffic
INBOUND_PLAINTEXT_PORT = 15006  # captured plaintext inbound traffic
HBONE_PORT = 15008  # HBONE (mTLS, HTTP/2 CONNECT) inbound
DNS_CAPTURE_PORT = 15053  # the DNS proxy, where captured port-53 traffic is sent
SOCKS5_PORT = 15080  # ztunnel's SOCKS5 listener (localhost, off by default)
ADMIN_PORT = 15000  # ztunnel admin (localhost)
STATS_PORT = 15020  # Prometheus scrape
READINESS_PORT = 15021  # /healthz/ready
XDS_CA_PORT = 15012  # istiod's TLS xDS and CA
CNI_MONITORING_PORT = 15014  # istio-cni's MONITORING_PORT (Prometheus)
CNI_HEALTH_PORT = 8000  # istio-cni's HEALTH_PORT (/healthz, /readyz)
DNS_PORT = 53  # plain DNS, what applications send and the upstream answers on
