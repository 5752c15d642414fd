"""Who may call what, for the server and the router alike: two scopes of API key, the
tenants of the inference keys, and the protections against web pages in the operator's
browser.

Keys (`Authorization: Bearer <key>`):
- an inference key reaches the inference routes: `--api-key` / RADIXSERVE_API_KEY (tenant
  "default") and those of `--api-keys-file` (each line's tenant);
- the admin key (`--admin-api-key` / RADIXSERVE_ADMIN_API_KEY) reaches every route,
  including the admin ones: what shows other tenants' data or changes server state. Its own
  requests belong to the tenant "admin".
A request's role ("admin" or "inference") and tenant are put in the ASGI scope
(`role(request)`, `tenant(request)`) for the routes whose answer depends on them
(`/cache_tree`, `/metrics`, aborts, the cache salt of a request). With no key set at all
every caller is admin, of tenant "default" (the loopback default); with only an admin key
the inference routes are open (tenant "default") and the admin ones need it; with only
inference keys no caller is admin. The admin key is compared in constant time; an inference
key is looked up by its SHA-256 digest (the time of a lookup depends on the digest, which
tells nothing of any key).

Cross-site (`CrossSiteGuard`): a Host outside the allowed names is refused (DNS rebinding:
a page on another name resolved to this address); a request body must be JSON (a form or
text/plain post, which a browser sends to any site without asking, gets 415); a
state-changing request whose Origin is another site gets 403.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Collection, Mapping
from urllib.parse import parse_qs, urlsplit

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.core.request import CacheSalt
from radixserve.keys import ADMIN_TENANT, DEFAULT_TENANT, LOOPBACK_NAMES
from radixserve.server.protocol import ApiError

ROLE_KEY = "radixserve.role"
TENANT_KEY = "radixserve.tenant"
PUBLIC_PATHS = frozenset({"/health"})  # reachable without a key (load balancers)
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def role(request: Request) -> str:
    """The caller's scope: "admin" or "inference" (set by ApiKeyMiddleware)."""
    return str(request.scope.get(ROLE_KEY, "admin"))


def tenant(request: Request) -> str:
    """The caller's tenant (set by ApiKeyMiddleware): its requests' owner and cache salt."""
    return str(request.scope.get(TENANT_KEY, DEFAULT_TENANT))


def stops(request: Request) -> str | None:
    """The tenant whose requests the caller may abort; None: any (the admin key)."""
    return None if role(request) == "admin" else tenant(request)


def cache_salt(request: Request, given: str) -> CacheSalt:
    """The salt of the caller's request whose own `cache_salt` is `given` ("" for none):
    its tenant's name too under --cache-isolation tenant."""
    isolated = request.app.state.config.cache_isolation == "tenant"
    return CacheSalt(tenant(request) if isolated else "", given)


def scoped_to(request: Request) -> str | None:
    """The tenant whose own part alone the caller sees of what every tenant shares (the
    cache tree, the metrics): itself, for an inference key when a keys file gives several
    tenants; None: all of it."""
    several = request.app.state.config.several_tenants
    return tenant(request) if several and role(request) != "admin" else None


def require_admin(request: Request, what: str) -> None:
    """ApiError 403 unless the caller holds the admin key."""
    if role(request) != "admin":
        raise ApiError(403, f"{what} needs the admin API key (--admin-api-key)")


async def _refuse(scope: Scope, receive: Receive, send: Send, err: ApiError) -> None:
    await err.response()(scope, receive, send)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeyMiddleware:
    """Sets the caller's role and tenant from its key and refuses the routes it does not
    reach.

    `tenant_keys`: {inference key: its tenant}. `admin_routes`: (method, path) pairs, "*" for
    any method; a path ending in "/" covers everything under it. The web console's page
    (`/`), which a browser opens without headers, takes the key as `?key=`."""

    def __init__(
        self,
        app: ASGIApp,
        tenant_keys: Mapping[str, str],
        admin_key: str | None,
        admin_routes: Collection[tuple[str, str]],
    ) -> None:
        self.app = app
        self.admin_key = admin_key
        self.tenants = {_digest(key): name for key, name in tenant_keys.items()}
        self.admin_routes = tuple(admin_routes)

    def _caller(self, given: str) -> tuple[str, str] | None:
        """(role, tenant) of the key `given`; None: no key it takes."""
        if self.admin_key is None and not self.tenants:
            return "admin", DEFAULT_TENANT
        admin = self.admin_key is not None and hmac.compare_digest(
            given.encode(), self.admin_key.encode()
        )
        found = self.tenants.get(_digest(given))
        if admin:
            return "admin", ADMIN_TENANT
        if found is not None:
            return "inference", found
        if not self.tenants:
            return "inference", DEFAULT_TENANT  # only an admin key: inference routes open
        return None

    def _is_admin_route(self, method: str, path: str) -> bool:
        return any(
            (m == "*" or m == method) and (path == p or (p.endswith("/") and path.startswith(p)))
            for m, p in self.admin_routes
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        given = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else ""
        if scope["path"] == "/" and not given:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            given = query.get("key", [""])[0]
        caller = self._caller(given)
        if caller is None:
            msg = "missing or invalid API key: send 'Authorization: Bearer <key>'"
            err = ApiError(401, msg, headers={"WWW-Authenticate": "Bearer"})
            await _refuse(scope, receive, send, err)
            return
        if caller[0] != "admin" and self._is_admin_route(scope["method"], scope["path"]):
            msg = f"{scope['method']} {scope['path']} needs the admin API key (--admin-api-key)"
            await _refuse(scope, receive, send, ApiError(403, msg))
            return
        scope[ROLE_KEY], scope[TENANT_KEY] = caller
        await self.app(scope, receive, send)


def allowed_hosts(bind_host: str, given: Collection[str]) -> frozenset[str] | None:
    """The Host names the guard accepts: `given` ("*" = any), else the loopback names when
    bound to loopback, else any (None)."""
    if "*" in given:
        return None
    if given:
        return frozenset(h.lower() for h in given)
    if bind_host in LOOPBACK_NAMES:
        return frozenset(LOOPBACK_NAMES)
    return None


def _hostname(netloc: str) -> str:
    return (urlsplit("//" + netloc).hostname or "").lower()


class CrossSiteGuard:
    """See the module docstring: Host check (`hosts` None = any), JSON bodies only, no
    state change from another site's page."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str] | None) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        if self.hosts is not None and _hostname(host) not in self.hosts:
            msg = f"Host {host!r} is not served here (--allowed-hosts names the accepted ones)"
            await _refuse(scope, receive, send, ApiError(400, msg, "Host"))
            return
        has_body = headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers
        media = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
        if has_body and media != "application/json" and not media.endswith("+json"):
            msg = f"Content-Type must be application/json, not {media or 'missing'!r}"
            await _refuse(scope, receive, send, ApiError(415, msg, "Content-Type"))
            return
        origin = headers.get(b"origin")
        if origin is not None and scope["method"] in STATE_CHANGING:
            source = origin.decode("latin-1")
            if source == "null" or urlsplit(source).netloc.lower() != host.lower():
                msg = f"cross-site {scope['method']} from {source!r} refused"
                await _refuse(scope, receive, send, ApiError(403, msg, "Origin"))
                return
        await self.app(scope, receive, send)
