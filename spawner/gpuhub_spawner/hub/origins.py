"""Per-user origins on one machine: the proxy that routes by host, and the hub's domain.

Without its own origin, a page served from one user's server runs on the hub's origin
and acts with the visitor's hub cookie (reads their pages, mints tokens in their name,
reads their MLflow runs). JupyterHub's answer is ``JupyterHub.subdomain_host``: each
user's server on ``<user>.<domain>``, each service on ``<service>.<domain>``.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

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
