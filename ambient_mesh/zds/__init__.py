"""ZDS: the node agent <-> node proxy protocol (package istio.workload.zds over a Unix
SOCK_SEQPACKET socket, netns fds passed with SCM_RIGHTS): codec, server and client."""
