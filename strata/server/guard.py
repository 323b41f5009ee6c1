"""Guard: the checks in front of every route, as plain ASGI middleware.

- Host: only the listening address, localhost (on a loopback or wildcard address) and
  --allowed-hosts; another name means a page on another site reached this server through
  DNS rebinding (403).
- Origin: a browser request from another origin is refused (403) unless --allowed-origins
  lists it (then CORS headers let the page read the answer).
- API key on /v1 routes: `Authorization: Bearer KEY` (scheme in any case), compared in
  constant time; 401 with `WWW-Authenticate: Bearer`.
- The body: larger than --max-body-bytes is a 413 (by Content-Length or while reading), not
  complete within --body-timeout seconds is a 408.

Plain ASGI on purpose: Starlette's BaseHTTPMiddleware (`@app.middleware("http")`) keeps
handlers from seeing that a client went away, and a request nobody reads must stop.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import time

from strata.server.config import ServerConfig
from strata.server.errors import send_error


class Guard:
    def __init__(self, app, config: ServerConfig):
        self.app, self.config = app, config
        self.key = config.api_key.encode() if config.api_key else None
        self.hosts = {h.lower() for h in config.allowed_hosts}
        self.origins = set(config.allowed_origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers") or []}
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            return await send_error(send, *refusal)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.config.max_body_bytes:
            return await self._too_large(send)
        started = False

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, self._body_limited(receive), sending)
        except _TooLarge:
            if not started:
                await self._too_large(send)
        except _Stalled:
            if not started:
                await send_error(send, 408, f"the request body did not arrive within "
                                            f"{self.config.body_timeout:g} s (--body-timeout)",
                                 [(b"connection", b"close")])

    def _refusal(self, scope, headers: dict) -> tuple | None:
        """(status, message[, headers]) when the request must not reach a route."""
        host = headers.get("host")
        if host is not None and not self._host_allowed(_host_name(host)):
            name = _host_name(host)
            return 403, (f"the Host header names '{name}', which is not this server's "
                         f"address; to serve that name start the server with "
                         f"--allowed-hosts {name}")
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, scope, host):
            return 403, (f"requests from the web origin '{origin}' are refused; to allow a "
                         f"browser page there start the server with --allowed-origins {origin}")
        needs_key = (self.key is not None and scope["path"].startswith("/v1")
                     and scope["method"] != "OPTIONS")  # NOTE: CORS preflights carry no key
        if needs_key and not self._key_matches(headers.get("authorization", "")):
            return (401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                    [(b"www-authenticate", b'Bearer realm="strata"')])
        return None

    def _host_allowed(self, name: str) -> bool:
        if "*" in self.hosts or name in self.hosts:
            return True
        config = self.config
        if config.wildcard:
            return name == "localhost" or _ip(name) is not None
        if name == config.host.lower():
            return True
        ip = _ip(name)
        return config.loopback and (name == "localhost" or ip is not None and ip.is_loopback)

    def _origin_allowed(self, origin: str, scope, host: str | None) -> bool:
        if "*" in self.origins or origin in self.origins:
            return True
        scheme = scope.get("scheme", "http")
        return host is not None and origin.lower() == f"{scheme}://{host}".lower()

    def _key_matches(self, authorization: str) -> bool:
        scheme, _, token = authorization.strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode("latin-1"), self.key)

    def _body_limited(self, receive):
        """`receive` that counts the body's bytes and times its arrival."""
        limit, timeout = self.config.max_body_bytes, self.config.body_timeout
        seen, complete, deadline = 0, False, None

        async def limited():
            nonlocal seen, complete, deadline
            if complete:
                return await receive()  # after the body: a disconnect, whenever it comes
            deadline = deadline or time.monotonic() + timeout
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                raise _Stalled() from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if seen > limit:
                    raise _TooLarge()
            else:
                complete = True
            return message

        return limited

    async def _too_large(self, send) -> None:
        await send_error(send, 413, f"the request body is larger than "
                                    f"{self.config.max_body_bytes} bytes (--max-body-bytes)",
                         [(b"connection", b"close")])


def _host_name(host: str) -> str:
    """The name in a Host header, without port or IPv6 brackets, in lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _ip(name: str):
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


class _TooLarge(Exception):
    pass


class _Stalled(Exception):
    pass
