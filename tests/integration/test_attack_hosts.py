"""The hub only on its own host: attacks through users' and services' hosts fail.

With per-user origins (``JupyterHub.subdomain_host``) bob's server is on ``bob.<domain>``.
JupyterHub itself does not check the Host header, and the proxy's default route used to
send every host to the hub, so ``http://bob.<domain>/hub/login?next=/user/bob/...`` was the
hub's real login page on bob's origin: carol logging in there left her login cookie where a
page bob serves could use it to read her hub pages and mint a token with all of her scopes.
Each attack test here passes only because the attack fails (each failed before the fix).

The hub runs on a domain like a real one (``hub.test``, resolved to loopback here and in
Chromium). With ``*.localhost`` Chromium drops JupyterHub's domain-wide session cookie
(``Domain=localhost``), which by accident keeps the XSRF check failing on bob's host; a real
domain keeps it, and there the token is minted (201) unless the hub refuses bob's host.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
from urllib.parse import quote, urlsplit

import pytest
import requests

from support.browser import chromium, fill_login_form
from support.hub import PASSWORD, Hub
from support.kernel import KernelSession
from test_local_hub import POLICY

pytestmark = pytest.mark.integration

DOMAIN = "hub.test"  # RFC 2606: never a real host
RESOLVE = [f"--host-resolver-rules=MAP {DOMAIN} 127.0.0.1, MAP *.{DOMAIN} 127.0.0.1"]  # the domain, for Chromium
REFUSED = "Not the hub's address"  # what the refusal says, on screen and in the body
API = "/api/2.0/mlflow"


@pytest.fixture(scope="module")
def resolve_domain():
    """This process resolves the hub's domain and its hosts to loopback, as Chromium is told to."""
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if isinstance(host, str) and (host == DOMAIN or host.endswith("." + DOMAIN)):
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    socket.getaddrinfo = getaddrinfo
    yield
    socket.getaddrinfo = real


@pytest.fixture(scope="module")
def hub(tmp_path_factory, resolve_domain):
    h = Hub(
        tmp_path_factory.mktemp("hosts"),
        POLICY,
        mlflow=True,  # MLflow: a service host to check
        env={"GPUHUB_DOMAIN": DOMAIN},
    )
    h.url = f"http://{DOMAIN}:{h.port}"
    h.start(timeout=120)
    yield h
    h.stop()


def mlflow_public(hub) -> str:
    return origin(hub, "mlflow--service") + "/services/mlflow"


@pytest.fixture(scope="module")
def users(hub):
    clients = {name: hub.login(name) for name in ("bob", "carol")}
    # MLflow starts with the hub and takes most of two cores for a while: let it finish
    # before servers start (a server gets 60 s), through its own host.
    deadline, last = time.time() + 300, None
    while time.time() < deadline:
        try:
            r = requests.get(
                mlflow_public(hub) + API + "/experiments/search",
                params={"max_results": 1},
                headers={"Authorization": f"Bearer {clients['carol'].token}"},
                timeout=200,
            )
            if r.status_code == 200:
                return clients
            last = (r.status_code, r.text[:200])
        except requests.RequestException as e:
            last = repr(e)
        time.sleep(0.5)
    raise AssertionError(f"MLflow not ready on its host: {last}\n{hub.tail(40)}")


# bob's page. On its own origin it can frame and read anything the hub serves there: a hub
# file in a frame sees the cookies of /hub/, among them the hub's XSRF token (JupyterHub's
# pages refuse frames, its static files do not), and with that token and whatever login
# cookie the hub left on this host the page mints a token with all of the visitor's scopes.
ATTACK_PAGE = """<!doctype html><html><body><script>
async function attack() {
  const out = {origin: location.origin};
  async function attempt(name, url, init) {
    try {
      const r = await fetch(url, Object.assign({credentials: "include"}, init || {}));
      out[name] = r.status + " " + (await r.text()).slice(0, 300);
    } catch (e) { out[name] = "blocked: " + e; }
  }
  out.xsrf = await new Promise(resolve => {
    const frame = document.createElement("iframe");
    frame.src = "/hub/static/css/style.min.css";
    frame.onload = () => {
      try {
        const m = /(?:^|; )_xsrf=([^;]*)/.exec(frame.contentDocument.cookie);
        resolve(m ? decodeURIComponent(m[1]) : null);
      } catch (e) { resolve(null); }
    };
    document.body.appendChild(frame);
    setTimeout(() => resolve(null), 30000);
  });
  const xsrf = {"X-XSRFToken": out.xsrf || ""};
  await attempt("whoami_same_host", "/hub/api/user", {headers: xsrf});
  await attempt("whoami_hub", %(hub)s + "/hub/api/user");
  const mint = {method: "POST", body: JSON.stringify({note: "stolen-by-bob"}),
                headers: Object.assign({"Content-Type": "application/json"}, xsrf)};
  await attempt("mint_same_host", "/hub/api/users/carol/tokens", mint);
  await attempt("mint_hub", %(hub)s + "/hub/api/users/carol/tokens", mint);
  window.attackResult = out;
}
attack();
</script></body></html>
"""


@pytest.fixture(scope="module")
def attack_url(hub, users):
    """bob's server serves the attack page to anyone, on bob's host, as any user can make it."""
    bob = users["bob"]
    assert bob.start("cpu").status_code in (201, 202)
    server = bob.wait_ready()
    kernel = KernelSession(hub.url, server["url"], bob.token, "setup.ipynb")
    try:  # from bob's own kernel: a page, and his server's config to serve it without login
        kernel.execute(
            "import pathlib\n"
            "home = pathlib.Path.home()\n"
            "(home / 'public').mkdir(exist_ok=True)\n"
            f"(home / 'public' / 'attack.html').write_text({ATTACK_PAGE % {'hub': json.dumps(hub.url)}!r})\n"
            "(home / '.jupyter').mkdir(exist_ok=True)\n"
            "(home / '.jupyter' / 'jupyter_server_config.py').write_text("
            "f'c.ServerApp.extra_static_paths = [{str(home / \"public\")!r}]\\n')\n"
        )
    finally:
        kernel.close()
    bob.stop()
    bob.wait_gone()
    assert bob.start("cpu").status_code in (201, 202)
    url = hub.server_url(bob.wait_ready()["url"]) + "static/attack.html"
    assert urlsplit(url).hostname == f"bob.{DOMAIN}", url
    assert requests.get(url).status_code == 200  # served to anyone: bob's choice
    return url


def origin(hub, name: str) -> str:
    """``http://<name>.hub.test:PORT``: a user's or service's own host."""
    return hub.url.replace(f"://{DOMAIN}", f"://{name}.{DOMAIN}")


@pytest.fixture(scope="module")
def browser():
    """Chromium that resolves the hub's domain (and every host below it) to loopback."""
    with chromium(RESOLVE) as b:
        yield b


def _login_on_the_form(page, name: str) -> None:
    fill_login_form(page, name)


def _stolen_tokens(user) -> list:
    tokens = user.api.get(user.url(f"/users/{user.name}/tokens")).json()["api_tokens"]
    return [t for t in tokens if t.get("note") == "stolen-by-bob"]


def _hub_cookies_on(context, host_origin: str) -> list:
    """Cookies the hub set on that host itself (host-only, under /hub)."""
    host = urlsplit(host_origin).hostname
    return [
        c
        for c in context.cookies([host_origin + "/hub/", host_origin + "/hub/api/", host_origin + "/"])
        if c["domain"] == host and c["path"].startswith("/hub")
    ]


@pytest.mark.browser
def test_carol_logging_in_on_bobs_host_gets_no_login_page_and_bobs_page_mints_nothing(hub, users, attack_url, browser, tmp_path):
    """The attack as described: carol follows bob's link to the 'login page' on bob's origin."""
    bob_origin = origin(hub, "bob")
    attack_path = urlsplit(attack_url).path
    context = browser.new_context()
    page = context.new_page()
    page.goto(f"{bob_origin}/hub/login?next={quote(attack_path)}")
    on_screen = page.locator("body").inner_text()
    login_form = page.locator("#username_input").count()
    cookies_from_the_link = _hub_cookies_on(context, bob_origin)
    page.screenshot(path=str(tmp_path / "bobs-host-login.png"))
    if login_form:  # the hub's own login form on bob's origin: carol logs in, as anyone would
        _login_on_the_form(page, "carol")
        page.wait_for_url("**/attack.html", timeout=60_000)
    else:  # carol logs in where the hub is, then opens bob's page anyway
        page.goto(hub.url + "/hub/login")
        _login_on_the_form(page, "carol")
        page.wait_for_url("**/hub/**", timeout=60_000)
        page.goto(attack_url)
    page.wait_for_function("window.attackResult !== undefined", timeout=60_000)
    result = page.evaluate("window.attackResult")
    cookies_after = _hub_cookies_on(context, bob_origin)
    context.close()
    print("\n[attack through bob's host]", json.dumps(result, indent=1)[:1500])

    assert not _stolen_tokens(users["carol"]), result  # bob's page minted nothing in carol's name
    for attempt in ("mint_same_host", "mint_hub", "whoami_same_host", "whoami_hub"):
        assert not (result.get(attempt) or "").startswith("20"), result
    assert result["xsrf"] is None, result  # no hub cookie reached the frame on bob's host
    # What carol saw on bob's host: an error, not the hub's login form.
    assert not login_form, on_screen[:500]
    assert REFUSED in on_screen, on_screen[:500]
    assert hub.url + "/hub/" in on_screen  # and where the hub really is
    # The hub set no cookie on bob's host, neither from the link nor afterwards.
    assert cookies_from_the_link == [] and cookies_after == [], (cookies_from_the_link, cookies_after)


def _get(url: str, host: str | None = None, method: str = "GET", body=None, headers=None) -> tuple[int, dict, str]:
    """A raw request (``http.client``: the path goes out exactly as written)."""
    u = urlsplit(url)
    # names of the test domain resolve to loopback (as the browser's rules map them); an address is itself
    to = u.hostname if re.fullmatch(r"[0-9.]+", u.hostname or "") else "127.0.0.1"
    conn = http.client.HTTPConnection(to, u.port, timeout=60)
    try:
        path = u.path + ("?" + u.query if u.query else "")
        conn.request(method, path, body=body, headers={"Host": host or u.netloc, **(headers or {})})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode(errors="replace")
    finally:
        conn.close()


HUB_PATHS = [
    "/hub/login?next=%2Fuser%2Fbob%2Fstatic%2Fattack.html",
    "/hub/api/",
    "/hub/api/user",
    "/hub/home",
    "/hub/spawn",
    "/hub/static/css/style.min.css",
    "/hub/logo",
    "/hub/error/404",
    "/hub/gpuhub",
]


def test_the_hubs_login_pages_api_and_static_files_are_refused_on_other_hosts(hub, users):
    """Through the proxy, with the users' and the MLflow service's hosts: 404, no cookie, never the hub."""
    carol = users["carol"]
    for name in ("bob", "carol", "mlflow--service"):
        host = urlsplit(origin(hub, name)).netloc
        for path in HUB_PATHS:
            status, headers, body = _get(hub.url + path, host=host)
            assert status == 404 and REFUSED in body, (host, path, status, body[:300])
            assert "set-cookie" not in headers, (host, path, headers)
        # carol's own token does not open the hub's API there either
        status, headers, body = _get(
            hub.url + "/hub/api/users/carol/tokens",
            host=host,
            method="POST",
            body=json.dumps({"note": "stolen-by-bob"}),
            headers={"Authorization": f"token {carol.token}", "Content-Type": "application/json"},
        )
        assert status == 404 and "set-cookie" not in headers, (host, status, body[:300])
        # nor does a password posted to the login form
        status, headers, body = _get(
            hub.url + "/hub/login",
            host=host,
            method="POST",
            body=f"username=carol&password={PASSWORD}",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        assert status == 404 and "set-cookie" not in headers, (host, status, body[:300])
    assert not _stolen_tokens(carol)


def test_the_hub_itself_refuses_other_hosts_of_its_domain(hub):
    """Without the proxy's help (Kubernetes: the chart's proxy sends unknown hosts to the hub)."""
    direct = f"http://{hub.users_reach_hub_at()}:{hub.hub_port}"  # where servers reach it (the wall's side as root)
    for name in ("bob", "mlflow--service"):
        host = urlsplit(origin(hub, name)).netloc
        for path in HUB_PATHS:
            status, headers, body = _get(direct + path, host=host)
            assert status == 404 and REFUSED in body, (host, path, status, body[:300])
            assert "set-cookie" not in headers, (host, path, headers)
    # What servers and services use, the hub's internal address, still answers.
    status, _, body = _get(direct + "/hub/api/")
    assert status == 200 and "version" in body


@pytest.mark.browser
def test_the_hub_bobs_server_and_mlflow_still_work_each_on_its_own_host(hub, users, attack_url, browser):
    bob, carol = users["bob"], users["carol"]
    # The hub, on its host.
    assert requests.get(hub.url + "/hub/api/").status_code == 200
    r = requests.get(hub.url + "/hub/login")
    assert r.status_code == 200 and 'id="username_input"' in r.text
    # bob's server, on bob's host: his page, and his API with his token.
    assert requests.get(attack_url).status_code == 200
    server = bob.server()
    r = requests.get(hub.server_url(server["url"]) + "api/status", headers={"Authorization": f"token {bob.token}"})
    assert r.status_code == 200, r.text[:300]
    # carol's server is not running: her host sends her to the hub's host (spawn page), as JupyterHub does.
    status, headers, _ = _get(origin(hub, "carol") + "/user/carol/tree?x=1")
    assert status == 302 and headers["location"] == hub.url + "/hub/user/carol/tree?x=1", headers
    # ... but her still-open JupyterLab's API fetches get JupyterHub's "not running" (424) on her
    # own origin: a redirect to the hub's origin is a cross-origin fetch the browser reports as
    # "Failed to fetch" (the walk test saw that raw dialog after a cull).
    status, headers, body = _get(origin(hub, "carol") + "/user/carol/api/kernels")
    assert status == 424 and "not running" in body, (status, headers, body[:200])
    status, headers, _ = _get(origin(hub, "carol") + "/user/carol/lab/workspaces/auto", headers={"Sec-Fetch-Mode": "cors"})
    assert status == 424, (status, headers)
    # Names nobody serves pages on (the machine's address, localhost) are sent to the hub's host.
    for name in ("127.0.0.1", "localhost"):
        status, headers, _ = _get(hub.url.replace(f"://{DOMAIN}", f"://{name}") + "/hub/login")
        assert status == 302 and headers["location"] == hub.url + "/hub/login", (name, headers)
    # MLflow, on its host: the API with a token, and the UI with single sign-on through the hub's host.
    public = mlflow_public(hub)
    r = requests.get(
        public + API + "/experiments/search",
        params={"max_results": 1},
        headers={"Authorization": f"Bearer {carol.token}"},
        timeout=200,
    )
    assert r.status_code == 200, r.text[:300]
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(hub.url + "/hub/login")
        _login_on_the_form(page, "carol")
        page.wait_for_url("**/hub/**", timeout=60_000)
        page.goto(public + "/")
        page.wait_for_url(public + "/**", timeout=60_000)  # back from the hub's authorize page
        assert REFUSED not in page.content() and "MLflow" in page.title(), (page.url, page.content()[:300])
    finally:
        context.close()


def test_cookie_host_prefix_follows_https_and_can_be_set_in_the_site_file(tmp_path, monkeypatch):
    """Item: __Host- login cookies (JupyterHub.cookie_host_prefix_enabled) from the site file."""
    from traitlets.config import Config

    from gpuhub_spawner.hub.origins import serve_hub_only_on_its_host
    from gpuhub_spawner.hub.auth import configure_site
    from gpuhub_spawner.hub.site import parse_site
    from gpuhub_spawner.policy.loader import PolicyError

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("x")
    key.write_text("x")

    def apply(text: str, subdomains: bool = True) -> Config:
        c = Config()
        c.ConfigurableHTTPProxy.command = ["configurable-http-proxy"]
        c.JupyterHub.hub_port = 8081
        if subdomains:
            c.JupyterHub.subdomain_host = "http://localhost:8000"
        configure_site(
            c, parse_site(text), policy_file=str(tmp_path / "none.yaml"), public_url="http://127.0.0.1:8000", demo=lambda c: None
        )
        serve_hub_only_on_its_host(c)
        return c

    monkeypatch.delenv("GPUHUB_DOMAIN", raising=False)
    https = f"https: {{certfile: {cert}, keyfile: {key}}}\n"
    assert apply(https).JupyterHub.cookie_host_prefix_enabled is True  # HTTPS with per-user origins: on
    assert apply("").JupyterHub.cookie_host_prefix_enabled is False  # plain HTTP: browsers would refuse it
    assert apply(https + "cookie_host_prefix: false\n").JupyterHub.cookie_host_prefix_enabled is False
    c = apply("public_url: https://gpu.example.org\ncookie_host_prefix: true\n")  # TLS ends in front of the hub
    assert c.JupyterHub.cookie_host_prefix_enabled is True
    # the public URL is where the hub answers, and the users' hosts hang off it
    assert c.JupyterHub.subdomain_host == "https://gpu.example.org" and c.JupyterHub.hub_routespec == "gpu.example.org/"
    assert "--default-target=http://127.0.0.1:8081/hub/gpuhub/other-host" in c.ConfigurableHTTPProxy.command
    with pytest.raises(PolicyError, match="needs HTTPS"):
        apply("cookie_host_prefix: true\n")
    with pytest.raises(PolicyError, match="per-user origins"):  # path / would reach servers on the hub's host
        apply(https + "cookie_host_prefix: true\n", subdomains=False)
    with pytest.raises(PolicyError, match="public_url"):
        parse_site("public_url: https://gpu.example.org/jupyter\n")
    monkeypatch.setenv("GPUHUB_DOMAIN", "other.example.org")
    with pytest.raises(PolicyError, match="GPUHUB_DOMAIN"):
        apply("public_url: https://gpu.example.org\n")
