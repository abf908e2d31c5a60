"""Wire usage into a hub: history, audit trail, metrics, roles from the policy's groups,
and the pages, API and CSV that show them (both backends: helm-values/values.yaml's
extraConfig calls ``configure_usage`` too)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from urllib.parse import unquote

from jupyterhub.apihandlers import APIHandler
from jupyterhub.log import log_request

from ..hub.roles import configure_policy_roles, follow_policy_roles
from ..hub.usage_api import handlers
from ..usage import recorder
from .app import app_of  # the usage pages read the admission view through it
from .startup import when_started


_SERVER_PATH = re.compile(r"/api/users/([^/]+)/(?:server|servers/([^/?]*))(?:/progress)?/?$")


def _audit_request(handler) -> None:
    """After each hub REST request: who started or stopped whose server (incl. admins acting
    on others). Starts from the spawn page are audited by ``_audit_page_spawn``."""
    rec = recorder.current()
    if rec is None:
        return
    req = handler.request
    if req.method not in ("POST", "DELETE") or handler.get_status() >= 400:
        return
    m = _SERVER_PATH.search(req.path)
    if not m or req.path.endswith("/progress"):
        return
    actor = getattr(handler, "_jupyterhub_user", None)
    by = getattr(actor, "name", None)
    if by is None:
        return
    owner, server = unquote(m.group(1)), unquote(m.group(2) or "")
    key = f"{owner}/{server}"
    action = "start" if req.method == "POST" else "stop"
    kind = "service" if getattr(actor, "kind", "user") == "service" else "user"
    rec.audit.record(f"{action}_requested", key=key, user=owner, by=by, by_kind=kind, status=handler.get_status())
    if action == "stop":
        rec.history.set_stopped_by(key, by)
    if by != owner and kind == "user":
        rec.audit.record("acted_on_server", by=by, role="hub-admin", target_user=owner, key=key, action=action)


def _audit_page_spawn(spawner) -> None:
    """At a spawn started from a page (``/hub/spawn[/<user>[/<server>]]``, its form or query):
    who asked for whose server. REST API starts are audited by ``_audit_request``.

    Runs as part of ``Spawner.pre_spawn_hook``: JupyterHub calls it once per spawn it
    actually begins, with ``spawner.handler`` the request that began it, so a form that
    fails validation or a request JupyterHub refuses (403/404, already running) is not
    recorded as a start.
    """
    rec = recorder.current()
    handler = getattr(spawner, "handler", None)
    if rec is None or handler is None or isinstance(handler, APIHandler):
        return
    actor = getattr(handler, "_jupyterhub_user", None)
    by = getattr(actor, "name", None)
    if by is None:
        return
    owner = spawner.user.name
    key = f"{owner}/{spawner.name}"
    kind = "service" if getattr(actor, "kind", "user") == "service" else "user"
    rec.audit.record("start_requested", key=key, user=owner, by=by, by_kind=kind, via="spawn page")
    if by != owner and kind == "user":
        rec.audit.record("acted_on_server", by=by, role="hub-admin", target_user=owner, key=key, action="start", via="spawn page")


def configure_usage(c, data_dir, policy=None) -> None:
    """History, audit trail, metrics, roles, pages (after ``configure_scopes``; one-machine hub)."""
    app_of(c)
    data = Path(data_dir)
    c.UsageRecorder.audit_file = str(data / "gpuhub-audit.jsonl")
    if "db_url" in c.JupyterHub:
        c.UsageRecorder.db_url = str(c.JupyterHub.db_url)
    c.JupyterHub.extra_handlers = (list(c.JupyterHub.extra_handlers) if "extra_handlers" in c.JupyterHub else []) + list(handlers)
    settings = dict(c.JupyterHub.tornado_settings) if "tornado_settings" in c.JupyterHub else {}
    inner = settings.get("log_function", log_request)

    def log_function(handler):
        inner(handler)
        try:
            _audit_request(handler)
        except Exception:  # auditing must never break a request
            logging.getLogger("JupyterHub.gpuhub.audit").exception("audit of a request failed")

    settings["log_function"] = log_function
    c.JupyterHub.tornado_settings = settings
    inner_hook = c.Spawner.pre_spawn_hook if "pre_spawn_hook" in c.Spawner else None

    def pre_spawn_hook(spawner):
        try:
            _audit_page_spawn(spawner)
        except Exception:  # auditing must never break a start
            logging.getLogger("JupyterHub.gpuhub.audit").exception("audit of a spawn failed")
        return inner_hook(spawner) if inner_hook else None

    c.Spawner.pre_spawn_hook = pre_spawn_hook
    if policy is not None:
        configure_policy_roles(c, policy)
        when_started(follow_policy_roles)
