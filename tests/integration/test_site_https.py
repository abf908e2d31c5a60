"""HTTPS from the site file: the hub (and users' servers behind it) answer over TLS only."""

import os
import subprocess

import pytest
import requests

from support.hub import Hub
from test_local_hub import POLICY

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def https_hub(tmp_path_factory):
    work = tmp_path_factory.mktemp("https")
    cert, key = work / "cert.pem", work / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,DNS:alice.localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    os.chmod(key, 0o600)
    site = work / "site.yaml"
    site.write_text(f"https: {{certfile: {cert}, keyfile: {key}}}\n")  # (OpenSSL refuses *.localhost: name each host)
    h = Hub(work, POLICY, env={"GPUHUB_SITE_CONFIG": str(site)})
    h.url = h.url.replace("http://", "https://")
    old = os.environ.get("REQUESTS_CA_BUNDLE")
    os.environ["REQUESTS_CA_BUNDLE"] = str(cert)  # the test trusts this hub's certificate, like a browser would
    try:
        h.start()
        yield h
    finally:
        h.stop()
        if old is None:
            os.environ.pop("REQUESTS_CA_BUNDLE", None)
        else:
            os.environ["REQUESTS_CA_BUNDLE"] = old


def test_hub_and_servers_are_served_over_tls(https_hub):
    hub = https_hub
    assert requests.get(hub.url + "/hub/api/").status_code == 200
    with pytest.raises(requests.ConnectionError):
        requests.get(hub.url.replace("https://", "http://") + "/hub/api/", timeout=5)
    alice = hub.login("alice")
    assert alice.start("cpu").status_code in (201, 202)
    s = alice.wait_ready()
    url = hub.server_url(s["url"])
    assert url.startswith("https://")
    assert requests.get(url + "api/status", headers={"Authorization": f"token {alice.token}"}).status_code == 200
    alice.stop()
    alice.wait_gone()
