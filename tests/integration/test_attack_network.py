"""The wall around each user, attacked from another user's kernel on a real hub run as root.

alice runs a server, a job and a Ray cluster (real Ray). The test reads, as root, every
listening TCP socket of every process of alice's account, each in the network view its
process has (``/proc/<pid>/net``), and bob, from a kernel of his own server, tries to connect
to each of those ports on 127.0.0.1, on alice's own address behind the wall, on the hub's
side of the wall and on every address of the machine. Zero connections: the test passes only
because the attack fails. alice's own kernel connects to each of them (the ports are real and
the probe works), bob's UDP datagrams never reach a socket alice opened, bob's submission to
Ray's dashboard agent (no token check in Ray 2.52) does not reach it, and carol's cluster,
started while alice's runs, submits a Ray job through its own agent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from support.hub import running_hub, wait_for
from support.walls import PROBE, account, host_listening_ports, listeners_of, machine_addresses, pid_arg as _pid_arg
from support.kernel import KernelSession

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="the wall needs a hub running as root (CI runs as root)"),
]
ray = pytest.importorskip("ray", reason="the ray extra (pip install -e '.[ray]')")

POLICY = """\
flavors:
  - name: gpu
    displayName: Tesla
    local: {virtual: 2}
teams:
  - {name: vision, displayName: Vision Lab, groups: [vision-lab], quota: {gpus: {gpu: 1}, cpu: "8"}}
  - {name: nlp, displayName: NLP, groups: [nlp-group], quota: {gpus: {gpu: 1}, cpu: "8"}}
profiles:
  - {slug: cpu, displayName: CPU only, teams: "*", default: true, cpu: "1", memory: 4Gi}
ray:
  enabled: true
"""


def cli(hub, user, *args, timeout=600):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "GPUHUB_TOKEN"))}
    e.update(GPUHUB_TOKEN=user.token)
    r = subprocess.run(
        [sys.executable, "-m", "gpuhub_spawner.cli", *args[:1], "--hub", hub.url, *args[1:]],
        capture_output=True,
        text=True,
        env=e,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stdout + r.stderr + hub.tail(40)
    return r.stdout


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with running_hub(tmp_path_factory.mktemp("wall"), POLICY, extra_config="c.LocalRayManager.check_interval = 1.0\n") as h:
        yield h


@pytest.fixture(autouse=True)
def servers_stopped_after(hub):
    """A test that fails midway leaves its users' servers running; the next test would meet
    "already running" (400) instead of what it tests."""
    yield
    for name in ("alice", "bob", "carol", "dave"):
        user = hub.login(name)
        if user.server() is not None:
            user.stop()
            user.wait_gone()


def kernel(hub, user) -> KernelSession:
    assert user.start("cpu").status_code in (201, 202)
    s = user.wait_ready(timeout=120)
    return KernelSession("", hub.server_url(s["url"]), user.token, f"wall-{uuid.uuid4().hex[:6]}.ipynb")


def test_bob_reaches_none_of_alices_ports_and_carols_cluster_takes_ray_jobs(hub, tmp_path):
    from gpuhub_spawner.local.user_network import Wall

    alice, bob, carol = hub.login("alice"), hub.login("bob"), hub.login("carol")
    wall = Wall.of(hub.user_network, hub.env["GPUHUB_ACCOUNT_PREFIX"])
    a_k = kernel(hub, alice)
    # A job of alice's that listens on every address of its network, as a careless one would.
    job = tmp_path / "listen.yaml"
    job.write_text(f"profile: cpu\ncommand: [{sys.executable}, -m, http.server, --bind, 0.0.0.0, '0']\n")
    job_id = cli(hub, alice, "job", "submit", str(job)).strip().splitlines()[-1]
    out = cli(hub, alice, "ray", "up", "--gpus", "0", "--name", "walled")
    assert "Ray cluster walled: running" in out, out
    # alice's UDP canary: a socket on every address of her network, counting what arrives.
    udp_port = int(
        a_k.execute(
            textwrap.dedent("""\
        import socket, threading
        canary = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        canary.bind(("0.0.0.0", 0))
        got = []
        threading.Thread(target=lambda: [got.append(canary.recvfrom(100)) for _ in iter(int, 1)], daemon=True).start()
        print(canary.getsockname()[1])
    """)
        ).strip()
    )

    uid = account(hub, "alice").pw_uid

    from urllib.parse import urlsplit

    served = urlsplit(alice.server_env()["JUPYTERHUB_SERVICE_URL"])
    a_addr, server_port = served.hostname, served.port  # her address behind the wall
    agent = _pid_arg(uid, b"--dashboard-agent-listen-port", b"--head")[1]
    job_pid = _pid_arg(uid, b"http.server")[0]

    def her_ports():
        ports = listeners_of(uid)
        return ports if {server_port, agent} <= set(ports) and any(v["pid"] == job_pid for v in ports.values()) else None

    ports = wait_for(
        her_ports,
        120,
        f"alice's server (port {server_port}), her job (pid {job_pid}) and her "
        f"cluster's dashboard agent (port {agent}) to listen",
    )
    print(
        f"alice listens on {len(ports)} TCP ports: "
        + ", ".join(f"{p} ({v['comm']} on {v['address']})" for p, v in sorted(ports.items()))
    )

    # alice reaches each of them from her own kernel: the list is real and the probe works.
    mine = [(v["address"] if v["address"] not in ("0.0.0.0", "::") else "127.0.0.1", p) for p, v in ports.items()]
    a_k.execute(PROBE)
    reached = json.loads(a_k.execute(f"print(json.dumps(probe({mine!r})))"))
    assert sorted(map(tuple, reached)) == sorted(mine), "alice cannot reach her own ports"

    # bob tries them all, on loopback, on alice's address, on the wall's hub side and on
    # every address of the machine (skipping ports the machine itself listens on there).
    b_k = kernel(hub, bob)
    b_k.execute(PROBE)
    host_ports = host_listening_ports()
    # (Other test hubs' bridges, elsewhere in 10.217.0.0/16, are the other workers': their hubs
    # come and go on those addresses during the probe; the machine's own addresses stay.)
    import ipaddress

    tests_net = ipaddress.ip_network("10.217.0.0/16")
    others = [a for a in machine_addresses() if ":" in a or ipaddress.ip_address(a) not in tests_net]
    addresses = ["127.0.0.1", a_addr, wall.gateway] + others
    targets = sorted(
        {(addr, p) for addr in addresses for p in ports if not (addr not in ("127.0.0.1", a_addr) and p in host_ports)}
    )
    got = json.loads(b_k.execute(f"print(json.dumps(probe({targets!r})))", timeout=120))
    # On an address of the machine's own, what answers is the machine's: alice's sockets are in
    # her namespace. A port taken there meanwhile (another test worker's hub or server) is not hers.
    now_host = host_listening_ports()
    got = [[a, p] for a, p in got if a in ("127.0.0.1", a_addr) or p not in now_host]
    # On loopback bob is in his own namespace: a port his own kernel drew there, from the same
    # ephemeral range alice's Ray drew hers from, answers him, not alice (a fresh-clone run:
    # bob "reached" 127.0.0.1:38191, her dashboard's port number). Where bob listens on a port,
    # his connection to it on loopback can only be his own.
    bob_own = listeners_of(account(hub, "bob").pw_uid)
    got = [[a, p] for a, p in got if not (a == "127.0.0.1" and p in bob_own)]
    assert got == [], f"bob reached alice's ports: {got}"
    # Nothing of bob's reaches alice's network at all: a closed port there does not even refuse.
    closed = json.loads(
        b_k.execute(
            textwrap.dedent(f"""\
        import socket
        s = socket.socket(); s.settimeout(4)
        print(json.dumps(s.connect_ex(({a_addr!r}, 1))))
    """)
        )
    )
    import errno

    assert closed != errno.ECONNREFUSED, "bob's packets reach alice's network stack"
    # Ray's dashboard agent (no token check in Ray 2.52): bob's submission finds no agent.
    attack = json.loads(
        b_k.execute(
            textwrap.dedent(f"""\
        import urllib.request
        results = []
        for host in ("127.0.0.1", {a_addr!r}, {wall.gateway!r}):
            for port in ({agent}, 52365):
                req = urllib.request.Request(f"http://{{host}}:{{port}}/api/job_agent/jobs/", method="POST",
                    data=json.dumps({{"entrypoint": "id > /tmp/pwned", "submission_id": "x1"}}).encode(),
                    headers={{"Content-Type": "application/json"}})
                try:
                    results.append([host, port, urllib.request.urlopen(req, timeout=4).status])
                except urllib.error.HTTPError as e:
                    results.append([host, port, e.code])
                except OSError:
                    pass
        print(json.dumps(results))
    """)
        )
    )
    assert attack == [], f"bob's agent submission got answers: {attack}"
    # UDP: bob's datagrams to alice's canary, on every address, never arrive.
    b_k.execute(
        textwrap.dedent(f"""\
        import socket
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for host in {addresses!r}:
            try:
                u.sendto(b"from bob", (host, {udp_port}))
            except OSError:
                pass
    """)
    )
    a_k.execute(
        textwrap.dedent(f"""\
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.sendto(b"from alice", ("127.0.0.1", {udp_port}))
    """)
    )
    wait_for(lambda: "from alice" in a_k.execute("print(got)"), 10, "alice's own datagram to reach her canary")
    assert "from bob" not in a_k.execute("print(got)")

    # carol's cluster, started while alice's runs, has a working agent: a Ray job runs.
    out = cli(hub, carol, "ray", "up", "--gpus", "0", "--name", "second")
    assert "Ray cluster second: running" in out, out
    c_k = kernel(hub, carol)
    dash = carol.api.get(carol.url("/gpuhub/ray/second")).json()["dashboard_port"]
    result = c_k.execute(
        textwrap.dedent(f"""\
        import os, time
        os.environ["RAY_AUTH_MODE"] = "token"
        from ray.job_submission import JobSubmissionClient, JobStatus
        client = JobSubmissionClient("http://127.0.0.1:{dash}")
        sid = client.submit_job(entrypoint="echo walled-$((6*7))")
        for _ in range(600):
            status = client.get_job_status(sid)
            if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
                break
            time.sleep(0.5)
        print(status, client.get_job_logs(sid))
    """),
        timeout=360,
    )
    assert "SUCCEEDED" in result and "walled-42" in result, result
    assert not any(p for p in (account(hub, "alice").pw_dir + "/pwned",) if os.path.exists(p))
    for user, name in ((alice, "walled"), (carol, "second")):
        cli(hub, user, "ray", "down", name)
    cli(hub, alice, "job", "cancel", job_id)
    for user in (alice, bob, carol):
        user.stop()


def test_users_reach_beyond_the_machine_and_nothing_beyond_reaches_them(hub):
    """The wall is between users, not between a user and the world: alice's kernel reaches a
    host outside the machine (a namespace of the test's own standing for it, routed through the
    machine), seen there as the machine's address (masqueraded); that host, even with a route
    to the users' network through the machine, reaches nothing of hers."""
    import random
    import shutil

    from urllib.parse import urlsplit

    if shutil.which("nft") is None:
        pytest.skip("no nft (Debian's nftables): the hub says users reach only this machine")
    alice = hub.login("alice")
    k = kernel(hub, alice)
    a_addr, a_port = (lambda u: (u.hostname, u.port))(urlsplit(alice.server_env()["JUPYTERHUB_SERVICE_URL"]))
    tag = uuid.uuid4().hex[:6]
    ns, veth, net = f"outside-{tag}", f"gwo{tag}", random.randrange(0, 256)
    here, there = f"198.18.{net}.1", f"198.18.{net}.2"
    sh = lambda *a: subprocess.run(a, check=True, capture_output=True, text=True)  # noqa: E731
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "addr", "add", f"{here}/30", "dev", veth)
        sh("ip", "link", "set", veth, "up")
        sh("ip", "-n", ns, "addr", "add", f"{there}/30", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "route", "add", hub.user_network, "via", here)  # as if the world knew the way
        server = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-c",
                textwrap.dedent(f"""\
                import socket
                s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(({there!r}, 8080)); s.listen(); print("up", flush=True)
                c, peer = s.accept(); c.sendall(b"hello from outside"); print("peer", peer[0], flush=True)
            """),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout.readline().strip() == "up"
            got = k.execute(
                textwrap.dedent(f"""\
                import socket
                print(socket.create_connection(({there!r}, 8080), timeout=15).recv(100).decode())
            """)
            )
            assert "hello from outside" in got, got
            assert server.stdout.readline().split() == ["peer", here]  # the machine's address, not hers
        finally:
            server.kill()
            server.wait()
        gateway = hub.users_reach_hub_at()  # the hub's side of the wall: its API listens there
        probe = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-c",
                textwrap.dedent(f"""\
            import socket
            for where in (({a_addr!r}, {a_port}), ({gateway!r}, {hub.hub_port})):
                s = socket.socket(); s.settimeout(5)
                print(s.connect_ex(where))
        """),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        # neither her server nor the hub's internal port answers a host beyond the machine
        assert len(probe.stdout.split()) == 2 and "0" not in probe.stdout.split(), probe.stdout + probe.stderr
    finally:
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        alice.stop()


def test_a_flushed_ruleset_is_put_back_when_the_next_user_arrives(hub):
    """Debian's nftables.conf starts with `flush ruleset`: an admin's restart of the firewall
    takes the wall's table away while forwarding stays on. The next user's set-up puts it back."""
    import shutil

    from gpuhub_spawner.local.user_network import Wall

    if shutil.which("nft") is None:
        pytest.skip("no nft (Debian's nftables)")
    table = Wall.of(hub.user_network, hub.env["GPUHUB_ACCOUNT_PREFIX"]).table
    # The proxy's and the hub's own connections to the hub's side (the bridge's address; out
    # through `lo`) are left alone by the wall's masquerade. Translated, they depended on the
    # table: when it went, the kernel stopped translating them and the hub reset the proxy's
    # kept-alive connection (the next login through the proxy got a 503). Read from the rule
    # the kernel holds: alone on a machine this test's login below fails without it, but
    # another hub's NAT table on the same machine keeps translating and would hide it.
    ruleset = json.loads(subprocess.run(["nft", "-j", "list", "table", "inet", table], capture_output=True, check=True).stdout)
    masquerades = [
        r["rule"]["expr"] for r in ruleset["nftables"] if "rule" in r and any("masquerade" in e for e in r["rule"]["expr"])
    ]
    assert masquerades, ruleset
    for expr in masquerades:
        oif = next(e["match"] for e in expr if "match" in e and e["match"]["left"].get("meta", {}).get("key") == "oifname")
        left_alone = oif["right"]["set"] if isinstance(oif["right"], dict) else [oif["right"]]
        assert oif["op"] == "!=" and "lo" in left_alone, ("the wall masquerades loopback too", expr)
    subprocess.run(["nft", "delete", "table", "inet", table], check=True)
    dave = hub.login("dave")
    try:
        assert dave.start("cpu").status_code in (201, 202)
        dave.wait_ready(timeout=120)
        assert subprocess.run(["nft", "list", "table", "inet", table], capture_output=True).returncode == 0
        assert f"the nftables table {table} of the wall was gone; putting it back" in hub.log.read_text()
    finally:
        dave.stop()
