"""A small, real OpenID Connect provider for tests: authorization code flow with PKCE.

It speaks the protocol the hub's OAuthenticator speaks to Keycloak, Authentik or Dex:
``/authorize`` (a login form; a POST with the right password redirects back with a
one-time code), ``/token`` (checks client secret, redirect URI, code and the PKCE
verifier; answers a bearer token), ``/userinfo`` (the user's claims, ``groups``
included), and ``/.well-known/openid-configuration``. Users and their groups are
changeable while it runs, as an administrator of the IdP would change them.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlencode, urlparse


class OidcProvider:
    def __init__(self, client_id: str, client_secret: str, redirect_uri: str):
        self.client_id, self.client_secret, self.redirect_uri = client_id, client_secret, redirect_uri
        self.users: dict[str, dict] = {}  # name -> {"password":..., "groups": [...]}
        self.codes: dict[str, dict] = {}
        self.tokens: dict[str, str] = {}
        self.log: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> "OidcProvider":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()

    def add_user(self, name: str, password: str, groups: list[str]) -> None:
        self.users[name] = {"password": password, "groups": list(groups)}

    def _handler(self):
        idp = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: str | dict = "", headers: dict | None = None):
                data = json.dumps(body).encode() if isinstance(body, dict) else body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json" if isinstance(body, dict) else "text/html")
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _form(self) -> dict:
                n = int(self.headers.get("Content-Length", 0))
                return {k: v[0] for k, v in parse_qs(self.rfile.read(n).decode()).items()}

            def do_GET(self):
                u = urlparse(self.path)
                q = {k: v[0] for k, v in parse_qs(u.query).items()}
                idp.log.append(f"GET {u.path}")
                if u.path == "/.well-known/openid-configuration":
                    return self._send(
                        200,
                        {
                            "issuer": idp.url,
                            "authorization_endpoint": idp.url + "/authorize",
                            "token_endpoint": idp.url + "/token",
                            "userinfo_endpoint": idp.url + "/userinfo",
                            "code_challenge_methods_supported": ["S256"],
                            "response_types_supported": ["code"],
                        },
                    )
                if u.path == "/authorize":
                    if q.get("client_id") != idp.client_id or q.get("redirect_uri") != idp.redirect_uri:
                        return self._send(
                            400, {"error": "invalid_request", "error_description": "unknown client or redirect_uri"}
                        )
                    if q.get("response_type") != "code" or q.get("code_challenge_method") != "S256":
                        return self._send(400, {"error": "invalid_request"})
                    hidden = "".join(
                        f'<input type="hidden" name="{html.escape(k)}" value="{html.escape(v)}">' for k, v in q.items()
                    )
                    return self._send(
                        200,
                        f'<form method="post" action="/authorize">{hidden}'
                        '<input name="username"><input name="password" type="password"></form>',
                    )
                if u.path == "/userinfo":
                    auth = self.headers.get("Authorization", "")
                    name = idp.tokens.get(auth.removeprefix("Bearer ").strip()) if auth.startswith("Bearer ") else None
                    if name is None:
                        return self._send(401, {"error": "invalid_token"})
                    return self._send(
                        200,
                        {
                            "sub": f"sub-{name}",
                            "preferred_username": name,
                            "email": f"{name}@example.org",
                            "groups": idp.users[name]["groups"],
                        },
                    )
                return self._send(404, {"error": "not_found"})

            def do_POST(self):
                u = urlparse(self.path)
                f = self._form()
                idp.log.append(f"POST {u.path}")
                if u.path == "/authorize":
                    user = idp.users.get(f.get("username", ""))
                    if user is None or not secrets.compare_digest(user["password"], f.get("password", "")):
                        return self._send(401, "<p>wrong username or password</p>")
                    code = secrets.token_urlsafe(16)
                    idp.codes[code] = {
                        "user": f["username"],
                        "challenge": f["code_challenge"],
                        "redirect_uri": f["redirect_uri"],
                        "at": time.time(),
                    }
                    return self._send(
                        302, "", {"Location": f"{f['redirect_uri']}?{urlencode({'code': code, 'state': f['state']})}"}
                    )
                if u.path == "/token":
                    if f.get("client_id") != idp.client_id or f.get("client_secret") != idp.client_secret:
                        return self._send(401, {"error": "invalid_client"})
                    grant = idp.codes.pop(f.get("code", ""), None)  # one use only
                    if (
                        grant is None
                        or f.get("grant_type") != "authorization_code"
                        or f.get("redirect_uri") != grant["redirect_uri"]
                    ):
                        return self._send(400, {"error": "invalid_grant"})
                    verifier = f.get("code_verifier", "")
                    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
                    if challenge != grant["challenge"]:
                        return self._send(400, {"error": "invalid_grant", "error_description": "PKCE verification failed"})
                    token = secrets.token_urlsafe(24)
                    idp.tokens[token] = grant["user"]
                    return self._send(
                        200, {"access_token": token, "token_type": "Bearer", "expires_in": 3600, "scope": "openid profile groups"}
                    )
                return self._send(404, {"error": "not_found"})

        return Handler
