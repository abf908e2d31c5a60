"""Per-user origins on one machine: the proxy that routes by host, and the hub's domain.

Without its own origin, a page served from one user's server runs on the hub's origin
and acts with the visitor's hub cookie (reads their pages, mints tokens in their name,
reads their MLflow runs). JupyterHub's answer is ``JupyterHub.subdomain_host``: each
user's server on ``<user>.<domain>``, each service on ``<service>--service.<domain>``.

That is only half of it: JupyterHub does not check the Host header, and the proxy's default
route sends every host to the hub. So ``bob.<domain>/hub/login`` was the real login page on
bob's origin, and a login there left the visitor's hub cookie where bob's pages could use it.
``serve_hub_only_on_its_host`` closes that twice: the proxy routes only the hub's own host to
the hub (any other host reaches a handler that only refuses or redirects), and inside the hub
a host rule ahead of every handler answers every other host of the domain the same way.
"""

from __future__ import annotations

import json

import logging
import os
import shutil
import sys
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

log = logging.getLogger("JupyterHub")


def node_proxy_command() -> list[str] | None:
    """The Node configurable-http-proxy (the one z2jh ships), if installed.

    It routes by host, which per-user origins need (the Python proxy 0.4.0 ignores the
    Host header), and has no cap on concurrent streams. ``GPUHUB_PROXY_COMMAND``
    overrides the choice; ``./run-hub.sh`` installs it into ``.venv/node``.
    """
    override = os.environ.get("GPUHUB_PROXY_COMMAND")
    if override:
        return override.split()
    candidate = Path(sys.prefix) / "node" / "node_modules" / ".bin" / "configurable-http-proxy"
    if candidate.exists() and shutil.which("node"):
        return [str(candidate)]
    return None


def subdomain_host(port: int) -> str:
    """``<scheme>://<domain>[:port]`` from ``GPUHUB_SCHEME``/``GPUHUB_DOMAIN``/``GPUHUB_PUBLIC_PORT``.

    The default domain ``localhost`` serves a demo: browsers resolve ``*.localhost`` to
    loopback, so ``alice.localhost`` needs no DNS.
    """
    scheme = os.environ.get("GPUHUB_SCHEME", "http")
    if scheme not in ("http", "https"):
        raise ValueError(f"GPUHUB_SCHEME must be http or https, not {scheme!r}")
    domain = os.environ.get("GPUHUB_DOMAIN", "localhost")
    public_port = int(os.environ.get("GPUHUB_PUBLIC_PORT", port))
    default_port = {"http": 80, "https": 443}[scheme]
    netloc = domain if public_port == default_port else f"{domain}:{public_port}"
    return f"{scheme}://{netloc}"


def public_url(port: int) -> str:
    """Where people open the hub, as ``configure_origins`` will set it up."""
    if os.environ.get("GPUHUB_SUBDOMAINS", "1") != "0" and node_proxy_command():
        return subdomain_host(port)
    return f"http://127.0.0.1:{port}"


def configure_origins(c, *, port: int, host_routing: bool) -> bool:
    """Give every user's server its own origin; warn loudly where that cannot be done.

    ``GPUHUB_SUBDOMAINS=0`` turns it off (for a lab whose users all trust each other).
    Returns whether subdomains are on.
    """
    if os.environ.get("GPUHUB_SUBDOMAINS", "1") == "0":
        warn_shared_origin("GPUHUB_SUBDOMAINS=0")
        return False
    if not host_routing:
        warn_shared_origin("the Node configurable-http-proxy, which routes by host, is not installed; ./run-hub.sh installs it")
        return False
    c.JupyterHub.subdomain_host = subdomain_host(port)
    return True


SHARED_ORIGIN_WARNING = (
    "\n" + "!" * 78 + "\n"
    "!! gpuhub: user servers share the hub's origin ({why}).\n"
    "!! Any user can publish a page from their server that acts as whoever opens it:\n"
    "!! it reads their hub pages, mints tokens in their name and reads their MLflow runs.\n"
    "!! Acceptable only when every user trusts every other. See docs/security.md.\n" + "!" * 78
)


def warn_shared_origin(why: str) -> None:
    msg = SHARED_ORIGIN_WARNING.format(why=why)
    log.warning(msg)
    print(msg, file=sys.stderr, flush=True)


# -- the hub only on its own host ------------------------------------------------------------
# Where a host other than the hub's ends up, under the hub's prefix: the proxy's default
# target (one machine) and, inside the hub, the host rule's handler. Both only refuse or
# redirect to the hub's host; neither reads a cookie or sets one.
OTHER_HOST_PATH = "gpuhub/other-host"


def is_other_host(host_name: str, domain: str) -> bool:
    """Whether ``host_name`` is a host under the hub's ``domain`` other than the hub's own.

    Those are the users' and services' origins (``bob.<domain>``, ``mlflow--service.<domain>``),
    where pages the hub does not control run. Other names (the hub's internal address, a
    Kubernetes service name) are not origins anyone else serves pages from.
    """
    name = (host_name or "").lower().rstrip(".")
    domain = (domain or "").lower().rstrip(".")
    return bool(domain) and name != domain and name.endswith("." + domain)


def _answer_other_host(handler) -> None:
    """Refuse (404, plain text, no cookie) or redirect to the hub's host; never serve the hub.

    On a user's or service's host (``bob.<domain>``): a request for ``/user/...`` reaches
    here when that server is not routed (stopped, or starting); like JupyterHub's own
    PrefixRedirectHandler it goes to ``<hub>/hub/user/...``, on the hub's host. Anything
    under ``/hub/`` (login, pages, API, static files) is refused. On a name under which nobody
    serves pages (``127.0.0.1:8000``, only through the proxy's default target) a GET is
    sent to the same path on the hub's host.
    """
    settings = handler.settings
    hub = settings.get("hub")
    hub_prefix = getattr(hub, "base_url", None) or "/hub/"
    base_url = settings.get("base_url", "/")
    public = settings.get("public_url")  # JupyterHub keeps it parsed
    hub_origin = (f"{public.scheme}://{public.netloc}" if public else "") or str(settings.get("subdomain_host") or "").rstrip("/")
    path = handler.request.path
    marker = hub_prefix + OTHER_HOST_PATH
    if path == marker or path.startswith(marker + "/"):  # the proxy's default target
        path = path[len(marker) :] or "/"
    inside_hub = (path.rstrip("/") + "/").startswith(hub_prefix)
    users_host = is_other_host(handler.request.host_name, settings.get("domain", ""))
    navigation = handler.request.headers.get("Sec-Fetch-Mode", "navigate") == "navigate"
    if users_host and not inside_hub and path.startswith(base_url) and (not navigation or "/api/" in path):
        # A stopped server's own API, fetched by its still-open JupyterLab: a redirect to the
        # hub's origin is a cross-origin fetch the browser reports as a network error ("Failed
        # to fetch"); answer here as JupyterHub does for a server that is not running.
        handler.clear()
        handler.set_status(424)
        handler.set_header("Content-Type", "application/json")
        handler.set_header("Cache-Control", "no-store")
        handler.finish(
            json.dumps({"status": 424, "message": "This server is not running. Start it again from the hub's home page."})
        )
        return
    if hub_origin and handler.request.method in ("GET", "HEAD") and path.startswith(base_url) and not (users_host and inside_hub):
        from jupyterhub.utils import url_path_join

        target = hub_origin + (url_path_join(hub_prefix, path[len(base_url) :] or "/") if users_host else path)
        if handler.request.query:
            target += "?" + handler.request.query
        handler.set_header("Cache-Control", "no-store")
        handler.redirect(target)
        return
    handler.clear()
    handler.set_status(404)
    handler.set_header("Content-Type", "text/plain; charset=utf-8")
    handler.set_header("X-Content-Type-Options", "nosniff")
    handler.set_header("Content-Security-Policy", "default-src 'none'")
    handler.set_header("Cache-Control", "no-store")
    where = f" only at {hub_origin}{hub_prefix}" if hub_origin else " on its own host only"
    handler.finish(
        "404 Not Found\n\nNot the hub's address: the hub's login, pages and API are served"
        f"{where}. This host is for a user's server or a service.\n"
    )


@cache
def _other_host_handler():
    from tornado import web

    class OtherHostHandler(web.RequestHandler):
        """Every request for the hub on another host. A plain tornado handler: no user, no cookie."""

        SUPPORTED_METHODS = ("GET", "HEAD", "POST", "DELETE", "PATCH", "PUT", "OPTIONS")

        def check_xsrf_cookie(self):  # it never acts; tornado's check would only add a 403
            pass

        def get_current_user(self):
            return None

        def prepare(self):
            _answer_other_host(self)

    return OtherHostHandler


@cache
def _hub_host_static_handler():
    from jupyterhub.handlers.static import CacheControlStaticFilesHandler

    class HubHostStaticHandler(CacheControlStaticFilesHandler):
        """JupyterHub's static files (tornado puts their routes first), on the hub's host only."""

        def prepare(self):
            if self.settings.get("subdomain_host") and is_other_host(self.request.host_name, self.settings.get("domain", "")):
                _answer_other_host(self)

    return HubHostStaticHandler


def _other_hosts_first(change) -> None:
    """Put a host rule for the domain's other hosts ahead of every hub handler (JupyterHub.handlers)."""
    from tornado.routing import Matcher

    app = change.owner
    domain = app.tornado_settings.get("domain") if app.subdomain_host else ""
    handlers = change.new
    if not domain or any(isinstance(h[0], Matcher) and getattr(h[0], "gpuhub_other_hosts", False) for h in handlers):
        return

    class OtherHostsOfTheDomain(Matcher):
        gpuhub_other_hosts = True

        def match(self, request):
            return {} if is_other_host(request.host_name, domain) else None

    handlers.insert(0, (OtherHostsOfTheDomain(), _other_host_handler()))


def serve_hub_only_on_its_host(c) -> None:
    """The hub's login, pages, API and static files only on its own host (with subdomains).

    Call after ``JupyterHub.subdomain_host`` is final. Both backends: on Kubernetes the
    chart's proxy sends unknown hosts to the hub, so the hub's own host rule is what holds
    there. Where this hub starts the Node proxy itself (one machine), the proxy also routes
    only the hub's host to the hub, and sends every other host to a handler that only
    refuses or redirects.
    """
    subdomain_host = str(c.JupyterHub.subdomain_host) if "subdomain_host" in c.JupyterHub else ""
    if not subdomain_host:
        return
    # Inside the hub: a host rule ahead of every handler, and JupyterHub's static files
    # (whose routes tornado puts ahead of everything) checked the same way.
    settings = dict(c.JupyterHub.tornado_settings) if "tornado_settings" in c.JupyterHub else {}
    settings["static_handler_class"] = _hub_host_static_handler()
    c.JupyterHub.tornado_settings = settings
    extra = list(c.JupyterHub.extra_handlers) if "extra_handlers" in c.JupyterHub else []
    if not any(h[0] == rf"/{OTHER_HOST_PATH}(?:/.*)?" for h in extra):
        c.JupyterHub.extra_handlers = extra + [(rf"/{OTHER_HOST_PATH}(?:/.*)?", _other_host_handler())]
    from jupyterhub.app import JupyterHub

    if JupyterHub.initialized():  # reading the config of a starting hub (not a test of the config)
        JupyterHub.instance().observe(_other_hosts_first, "handlers")

    # In the proxy this hub starts: the hub's route on its host only, not the default route
    # that answers every host, and a default target that only refuses or redirects.
    proxy = c.ConfigurableHTTPProxy
    if "command" in proxy and (proxy.should_start if "should_start" in proxy else True):
        c.JupyterHub.hub_routespec = f"{urlsplit(subdomain_host).hostname}/"
        hub_ip = (c.JupyterHub.hub_ip if "hub_ip" in c.JupyterHub else "") or "127.0.0.1"
        hub_ip = "127.0.0.1" if hub_ip in ("0.0.0.0", "::") else hub_ip
        hub_port = int(c.JupyterHub.hub_port) if "hub_port" in c.JupyterHub else 8081
        command = [a for a in proxy.command if not str(a).startswith("--default-target")]
        proxy.command = [*command, f"--default-target=http://{hub_ip}:{hub_port}/hub/{OTHER_HOST_PATH}"]
        log.info(
            "gpuhub: the hub answers only on %s; every other host gets a refusal or a redirect there "
            "(so JupyterHub's 'Using custom route for Hub' warning is expected)",
            urlsplit(subdomain_host).netloc,
        )
