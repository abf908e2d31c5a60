"""A local authenticator with demo users and groups, for the one-machine default.

Groups come from config exactly as OAuthenticator would deliver them from an identity
provider (``manage_groups``), so the team mapping is exercised the same way.
"""

from __future__ import annotations

import hmac

from jupyterhub.auth import Authenticator
from traitlets import Dict, Unicode, default


class DemoAuthenticator(Authenticator):
    demo_users = Dict(
        help="""Demo users: {name: {"groups": [...], "admin": bool}}.""",
    ).tag(config=True)

    demo_password = Unicode(help="The one password of every demo user.").tag(config=True)

    @default("manage_groups")
    def _manage_groups(self):
        return True

    @default("allow_all")
    def _allow_all(self):
        return True  # only names in demo_users can authenticate at all

    async def authenticate(self, handler, data):
        name = (data or {}).get("username", "")
        password = (data or {}).get("password", "")
        user = self.demo_users.get(name)
        if user is None or not self.demo_password:
            return None
        if not hmac.compare_digest(password.encode(), self.demo_password.encode()):
            return None
        return {"name": name, "groups": list(user.get("groups", [])), "admin": bool(user.get("admin", False))}
