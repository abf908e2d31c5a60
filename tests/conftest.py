import sys
from pathlib import Path

# tests.support is importable as `support` from every test directory.
sys.path.insert(0, str(Path(__file__).resolve().parent))


# Browsers resolve every *.localhost name to loopback (RFC 6761); glibc does not. The demo
# gives each user's server its own origin on <user>.localhost, so the test process resolves
# those names the way a browser would.
import socket as _socket

_real_getaddrinfo = _socket.getaddrinfo


def _getaddrinfo(host, *args, **kwargs):
    if isinstance(host, str) and host.endswith(".localhost"):
        host = "127.0.0.1"
    return _real_getaddrinfo(host, *args, **kwargs)


_socket.getaddrinfo = _getaddrinfo


# Python's cookie jar treats a dotless host ("localhost") as "localhost.local" (RFC 2965) and
# then neither matches nor returns the hub's session cookie for Domain=localhost, which all
# <user>.localhost origins share. Browsers follow RFC 6265 here; so do the tests.
import http.cookiejar as _cookiejar


def _is_localhost(name: str) -> bool:
    name = name.lstrip(".").split(":")[0]
    return name == "localhost" or name.endswith(".localhost")


def _domain_match_6265(cookie_domain: str, host: str) -> bool:
    d = cookie_domain.lstrip(".")
    return host == d or host.endswith("." + d)


_policy = _cookiejar.DefaultCookiePolicy
_orig = {n: getattr(_policy, n) for n in ("set_ok_domain", "return_ok_domain", "domain_return_ok")}


def _set_ok_domain(self, cookie, request):
    host = _cookiejar.request_host(request)
    if _is_localhost(host) and cookie.domain_specified:
        return _domain_match_6265(cookie.domain, host)
    return _orig["set_ok_domain"](self, cookie, request)


def _return_ok_domain(self, cookie, request):
    host = _cookiejar.request_host(request)
    if _is_localhost(host):
        if cookie.domain_specified:
            return _domain_match_6265(cookie.domain, host)
        return cookie.domain in (host, host + ".local")  # host-only: stored under the RFC 2965 name
    return _orig["return_ok_domain"](self, cookie, request)


def _domain_return_ok(self, domain, request):
    host = _cookiejar.request_host(request)
    if _is_localhost(host):
        return _domain_match_6265(domain, host) or domain == host + ".local"
    return _orig["domain_return_ok"](self, domain, request)


_policy.set_ok_domain = _set_ok_domain
_policy.return_ok_domain = _return_ok_domain
_policy.domain_return_ok = _domain_return_ok
