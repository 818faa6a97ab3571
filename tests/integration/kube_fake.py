"""An in-process fake Kubernetes API server for the kube/ client, the node agent and the control plane.

What it speaks, over HTTP/1.1 on loopback (one request per connection): bearer-token auth (401
otherwise); list of any kind, cluster-wide or in a namespace, with `fieldSelector=spec.nodeName=`
and the list's resourceVersion; watch as chunked JSON lines from a resourceVersion, with BOOKMARK
events when asked (`allowWatchBookmarks`), and 410 Gone for a version older than the compaction
point (as an ERROR event, or as the watch response's status with `gone_as_http_status`); GET;
merge PATCH on `<kind>/status` (annotations for pods, `status` for every kind, each recorded
in `status_patches`); POST of TokenReviews answered from `token_reviews`; for
ConfigMaps also `fieldSelector=metadata.name=`, POST (409 when it exists) and PUT (409 when its
resourceVersion is not the current one); server-side apply (PATCH `application/apply-patch+yaml`
on an object path: created, or its top-level fields replaced; recorded in `applies` with the
field manager) and DELETE of any kind; TokenRequest (POST serviceaccounts/NAME/token) minting
tokens that are accepted only for the reads `scoped_rights` gives that account (other requests
with them: 403), expiring `minted_ttl_s` after issue if set (else as asked), refused with
`token_request_status` if set. Plain HTTP, or TLS with the given server context. Every request is recorded as
(method, target, content-type, body).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import json
import ssl
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ambient_mesh.admin import parse_request

TOKEN = "sekret"

# plural -> kind for every kind the tests use (the API server's discovery, in short).
KINDS = {
    "pods": "Pod",
    "namespaces": "Namespace",
    "services": "Service",
    "serviceaccounts": "ServiceAccount",
    "nodes": "Node",
    "daemonsets": "DaemonSet",
    "authorizationpolicies": "AuthorizationPolicy",
    "peerauthentications": "PeerAuthentication",
    "serviceentries": "ServiceEntry",
    "workloadentries": "WorkloadEntry",
    "gateways": "Gateway",
    "httproutes": "HTTPRoute",
    "virtualservices": "VirtualService",
    "configmaps": "ConfigMap",
    "deployments": "Deployment",
}


def self_signed(common_name: str) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) for 127.0.0.1, the way an API server's serving cert names its IP."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def api_tls(cert_pem: bytes, key_pem: bytes, directory: Path) -> ssl.SSLContext:
    (directory / "api.crt").write_bytes(cert_pem)
    (directory / "api.key").write_bytes(key_pem)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(directory / "api.crt", directory / "api.key")
    return tls


def _copy(doc: dict) -> dict:
    return json.loads(json.dumps(doc))


class FakeApiServer:
    """Objects with resource versions; watchers fed from one event log."""

    def __init__(self, token: str = TOKEN, *, tls: ssl.SSLContext | None = None) -> None:
        self.token = token
        self.tls = tls
        self.rv = 100
        self.objects: dict[tuple[str, str, str], dict] = {}  # (kind, namespace, name)
        self.log: list[tuple[int, str, str, dict]] = []  # (rv, kind, type, object)
        self.compacted_before = 0  # watches from an older version get 410
        self.gone_as_http_status = False
        self.token_reviews: dict[str, dict] = {}  # token -> TokenReview status
        self.status_patches: list[tuple[str, str, str, dict]] = []  # (kind, namespace, name, patch)
        self.applies: list[tuple[str, str, str, str]] = []  # (kind, namespace, name, fieldManager)
        self.unserved: set[str] = set()  # plurals answered 404, as for a CRD not installed
        self.forbidden_namespaces: set[str] = set()  # writes there are answered 403
        self.requests: list[tuple[str, str, str, bytes]] = []
        # TokenRequest: minted token -> (namespace/account, what it may do: {(method, plural)})
        self.minted: dict[str, tuple[str, frozenset[tuple[str, str]]]] = {}
        self.scoped_rights: dict[str, frozenset[tuple[str, str]]] = {
            "istio-system/istio-cni-plugin": frozenset({("GET", "pods"), ("GET", "namespaces")})
        }
        self.token_requests: list[dict] = []  # each request's namespace, account and spec
        self.token_request_status: int | None = None
        self.minted_ttl_s: float | None = None
        self.authorizations: list[str | None] = []
        self.changed = asyncio.Condition()
        self.server: asyncio.Server | None = None
        self.port = 0
        self.watchers = 0

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 1)

    async def put(self, obj: dict, *, delete: bool = False) -> dict:
        kind = obj["kind"]
        key = (kind, obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        self.rv += 1
        obj = _copy(obj)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        existed = key in self.objects
        if delete:
            self.objects.pop(key, None)
            kind_of_event = "DELETED"
        else:
            self.objects[key] = obj
            kind_of_event = "MODIFIED" if existed else "ADDED"
        self.log.append((self.rv, kind, kind_of_event, obj))
        async with self.changed:
            self.changed.notify_all()
        return obj

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        await self.put(self.objects[(kind, namespace, name)], delete=True)

    def gets(self) -> list[str]:
        return [unquote(urlsplit(t).path) for m, t, _, _ in self.requests if m == "GET"]

    def watches(self, plural: str) -> list[str]:
        return [t for m, t, _, _ in self.requests if "watch=true" in t and urlsplit(t).path.endswith(plural)]

    @staticmethod
    def _matches(obj: dict, namespace: str | None, node: str | None, name: str | None = None) -> bool:
        if namespace is not None and obj["metadata"].get("namespace", "") != namespace:
            return False
        if name is not None and obj["metadata"].get("name") != name:
            return False
        return node is None or obj.get("spec", {}).get("nodeName") == node

    def _list(self, kind: str, namespace: str | None, node: str | None, name: str | None = None) -> dict:
        items = []
        for (k, _, _), obj in sorted(self.objects.items()):
            if k == kind and self._matches(obj, namespace, node, name):
                item = _copy(obj)
                # Like the real server: list items carry neither kind nor apiVersion.
                item.pop("kind", None)
                item.pop("apiVersion", None)
                items.append(item)
        return {"kind": f"{kind}List", "metadata": {"resourceVersion": str(self.rv)}, "items": items}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            data = b""
            while (parsed := parse_request(data)) is None:
                chunk = await reader.read(65536)
                if not chunk:
                    return
                data += chunk
            request = parsed[0]
            self.requests.append(
                (request.method, request.target, request.header("content-type") or "", request.body)
            )
            self.authorizations.append(request.header("authorization"))
            bearer = (request.header("authorization") or "").removeprefix("Bearer ")
            if bearer != self.token and bearer not in self.minted:
                await self._reply(writer, 401, {"kind": "Status", "code": 401, "message": "Unauthorized"})
                return
            if bearer != self.token and not self._allowed(bearer, request):
                await self._reply(writer, 403, {"kind": "Status", "code": 403, "reason": "Forbidden"})
                return
            await self._route(request, writer)
        except (ConnectionError, ssl.SSLError, asyncio.CancelledError):
            pass  # ssl.SSLError: a client that rejected our certificate
        finally:
            writer.close()

    def _allowed(self, token: str, request) -> bool:
        """A minted token's rights: GET of single objects of the kinds its account may read."""
        _account, rights = self.minted[token]
        url = urlsplit(request.target)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        rest = parts[2:] if parts[:1] == ["api"] else parts[3:]
        if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] in KINDS:
            rest = rest[2:]
        single = len(rest) == 2 and not url.query
        return single and (request.method, rest[0]) in rights

    def revoke(self, token: str) -> None:
        self.minted.pop(token, None)

    async def _token_request(
        self, writer: asyncio.StreamWriter, namespace: str, account: str, body: dict
    ) -> None:
        spec = body.get("spec") or {}
        self.token_requests.append({"namespace": namespace, "account": account, "spec": spec})
        if self.token_request_status is not None:
            status = self.token_request_status
            await self._reply(writer, status, {"kind": "Status", "code": status, "reason": "Forbidden"})
            return
        token = f"minted-{len(self.token_requests)}"
        self.minted[token] = (
            f"{namespace}/{account}",
            self.scoped_rights.get(f"{namespace}/{account}", frozenset()),
        )
        ttl = (
            self.minted_ttl_s
            if self.minted_ttl_s is not None
            else float(spec.get("expirationSeconds") or 3600)
        )
        expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=ttl)
        answer = {
            "kind": "TokenRequest",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"name": account, "namespace": namespace},
            "spec": spec,
            "status": {"token": token, "expirationTimestamp": expires.strftime("%Y-%m-%dT%H:%M:%SZ")},
        }
        await self._reply(writer, 201, answer)

    async def _route(self, request, writer: asyncio.StreamWriter) -> None:
        url = urlsplit(request.target)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        # /api/v1/... or /apis/<group>/<version>/...
        rest = parts[2:] if parts[:1] == ["api"] else parts[3:]
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] in KINDS:
            namespace, rest = rest[1], rest[2:]
        if rest[:1] == ["serviceaccounts"] and rest[2:] == ["token"] and request.method == "POST":
            await self._token_request(writer, namespace or "", rest[1], json.loads(request.body))
            return
        if rest[:1] == ["tokenreviews"] and request.method == "POST":
            await self._token_review(writer, json.loads(request.body))
            return
        if not rest or rest[0] not in KINDS or rest[0] in self.unserved:
            await self._reply(writer, 404, {"kind": "Status", "code": 404, "message": "no such path"})
            return
        kind = KINDS[rest[0]]
        selector = query.get("fieldSelector", "")
        node = selector.removeprefix("spec.nodeName=") if selector.startswith("spec.nodeName=") else None
        name = selector.removeprefix("metadata.name=") if selector.startswith("metadata.name=") else None
        if request.method in ("POST", "PUT", "PATCH") and namespace in self.forbidden_namespaces:
            await self._reply(writer, 403, {"kind": "Status", "code": 403, "reason": "Forbidden"})
            return
        if len(rest) == 1 and request.method == "POST" and kind == "ConfigMap":
            obj = json.loads(request.body)
            obj["metadata"]["namespace"] = namespace or ""
            if (kind, namespace or "", obj["metadata"]["name"]) in self.objects:
                await self._reply(writer, 409, {"kind": "Status", "code": 409, "reason": "AlreadyExists"})
            else:
                await self._reply(writer, 201, await self.put({**obj, "kind": kind}))
            return
        if len(rest) == 1:
            if query.get("watch") in ("1", "true"):
                await self._watch(
                    writer,
                    kind,
                    namespace,
                    node,
                    int(query.get("resourceVersion") or 0),
                    bookmarks=query.get("allowWatchBookmarks") == "true",
                    name=name,
                )
            else:
                await self._reply(writer, 200, self._list(kind, namespace, node, name))
            return
        key = (kind, namespace or "", rest[1])
        if (
            request.method == "PATCH"
            and not rest[2:]
            and (request.header("content-type") or "").startswith("application/apply-patch")
        ):
            body = json.loads(request.body)  # JSON is YAML; lightkube sends JSON
            self.applies.append((kind, namespace or "", rest[1], query.get("fieldManager", "")))
            obj = {**_copy(self.objects.get(key, {})), **body, "kind": kind}
            obj["metadata"] = {**obj.get("metadata", {}), "namespace": namespace or ""}
            obj["metadata"].setdefault("uid", f"uid-{kind.lower()}-{rest[1]}")
            await self._reply(writer, 200 if key in self.objects else 201, await self.put(obj))
            return
        if key not in self.objects:
            await self._reply(writer, 404, {"kind": "Status", "code": 404, "message": "not found"})
        elif request.method == "PUT" and kind == "ConfigMap" and not rest[2:]:
            obj = json.loads(request.body)
            current = self.objects[key]["metadata"]["resourceVersion"]
            if obj.get("metadata", {}).get("resourceVersion") != current:
                await self._reply(writer, 409, {"kind": "Status", "code": 409, "reason": "Conflict"})
            else:
                await self._reply(writer, 200, await self.put({**obj, "kind": kind}))
        elif request.method == "DELETE" and not rest[2:]:
            await self.delete(*key)
            await self._reply(writer, 200, {"kind": "Status", "code": 200, "status": "Success"})
        elif request.method == "PATCH" and rest[2:] == ["status"]:
            patch = json.loads(request.body)
            obj = _copy(self.objects[key])
            self.status_patches.append((kind, namespace or "", rest[1], patch))
            annotations = obj["metadata"].setdefault("annotations", {})
            for k, v in patch.get("metadata", {}).get("annotations", {}).items():
                if v is None:
                    annotations.pop(k, None)
                else:
                    annotations[k] = v
            # A status subresource takes only `status` (and pods/status the annotations above);
            # a merge patch replaces each key of it, lists whole (RFC 7386).
            for k, v in patch.get("status", {}).items():
                if v is None:
                    obj.setdefault("status", {}).pop(k, None)
                else:
                    obj.setdefault("status", {})[k] = v
            await self._reply(writer, 200, await self.put(obj))
        else:
            await self._reply(writer, 200, self.objects[key])

    async def _token_review(self, writer: asyncio.StreamWriter, review: dict) -> None:
        token = review.get("spec", {}).get("token", "")
        audiences = review.get("spec", {}).get("audiences")
        status = _copy(
            self.token_reviews.get(token, {"authenticated": False, "error": "invalid bearer token"})
        )
        # The real authenticator answers the audiences the token is valid for among those asked.
        if status.get("authenticated") and audiences is not None:
            valid = [a for a in status.get("audiences", []) if a in audiences]
            if not valid:
                status = {"authenticated": False, "error": "token audiences are invalid"}
            else:
                status["audiences"] = valid
        answer = {"kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1", "spec": review["spec"]}
        answer["status"] = status
        await self._reply(writer, 201, answer)

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, status: int, doc: dict) -> None:
        body = json.dumps(doc).encode()
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()

    async def _watch(
        self,
        writer: asyncio.StreamWriter,
        kind: str,
        namespace: str | None,
        node: str | None,
        since: int,
        *,
        bookmarks: bool,
        name: str | None = None,
    ) -> None:
        if since < self.compacted_before and self.gone_as_http_status:
            await self._reply(
                writer, 410, {"kind": "Status", "code": 410, "reason": "Expired", "message": "gone"}
            )
            return
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )

        def send(doc: dict) -> None:
            line = json.dumps(doc).encode() + b"\n"
            writer.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")

        if since < self.compacted_before:
            send({"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}})
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return
        self.watchers += 1
        sent = since
        try:
            while True:
                for rv, k, kind_of_event, obj in self.log:
                    if rv > sent and k == kind and self._matches(obj, namespace, node, name):
                        send({"type": kind_of_event, "object": obj})
                    sent = max(sent, rv)
                if bookmarks:
                    send(
                        {
                            "type": "BOOKMARK",
                            "object": {"kind": kind, "metadata": {"resourceVersion": str(sent)}},
                        }
                    )
                await writer.drain()
                async with self.changed:
                    await self.changed.wait_for(lambda s=sent: self.rv > s)
        finally:
            self.watchers -= 1
