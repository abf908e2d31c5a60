"""Secrets per profile and team data, against a real hub run as root (issue 42, items 1 and 2).

The policy names two secrets by reference (a YAML file of root's outside the policy): ``wandb``
as a file for the ``secure`` profile, ``hf`` as ``HF_TOKEN`` for Vision Lab on ``secure``; and
three datasets: Vision Lab's ``imagenet`` (read-only) and ``scratch`` (read-write), NLP's
``corpora``, each under a directory only root may enter.

- alice (Vision Lab, ``secure``) reads both in her kernel and her job, can write ``scratch`` but
  not ``imagenet``; a rewritten secret file reaches her next job, with no hub restart.
- bob (Vision Lab, ``cpu``: not granted) and carol (NLP) try every road from their own kernels:
  the file path, alice's ``/proc/<pid>/environ`` and ``/proc/<pid>/root``, every process's
  environment, the admin's file itself, Vision Lab's data directories; bob's token against
  alice's server and her job's record.
- victor (viewer), the job records API, the policy and its history page, the audit trail, the
  usage pages, the hub's log (DEBUG) and everything under the hub's data directory: no value.
- the audit trail says which secret went to whom for which server or job (names only).
- a missing secret file stops the start with a plain message; the log says where and why.
"""

from __future__ import annotations

import hashlib
import json
import os
import textwrap
import uuid
from pathlib import Path

import pytest

from support.hub import Hub, processes_with_env, wait_for
from support.kernel import KernelSession

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="per-user isolation (and so private secrets) needs a hub running as root"),
]

WANDB = "wandb-" + uuid.uuid4().hex  # what nobody but alice may ever see
HF = "hf-" + uuid.uuid4().hex
ROTATED = "rotated-" + uuid.uuid4().hex
VALUES = (WANDB, HF, ROTATED)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """Root's secret file and the teams' data, each under a directory only root may enter."""
    top = tmp_path_factory.mktemp("secrets-and-data")
    etc, data = top / "etc", top / "data"
    etc.mkdir(mode=0o700)
    data.mkdir(mode=0o700)
    secrets = etc / "secrets.yaml"
    secrets.write_text(f"wandb: {WANDB}\nhf: {HF}\n")
    secrets.chmod(0o600)
    for name in ("imagenet", "scratch", "corpora"):
        (data / name).mkdir(mode=0o755)
    (data / "scratch").chmod(0o1777)  # any member of the team it is granted to may write
    (data / "imagenet" / "README").write_text("vision's images\n")
    (data / "corpora" / "README").write_text("nlp's corpora\n")
    return {"secrets": secrets, "data": data}


@pytest.fixture(scope="module")
def hub(tmp_path_factory, places):
    policy = textwrap.dedent(f"""\
        teams:
          - {{name: vision, displayName: Vision Lab, groups: [vision-lab]}}
          - {{name: nlp, displayName: NLP, groups: [nlp-group]}}
        profiles:
          - {{slug: cpu, displayName: CPU only, teams: "*", default: true, cpu: 500m, memory: 1Gi}}
          - {{slug: secure, displayName: With credentials, teams: [vision, nlp], cpu: 500m, memory: 4Gi}}
          - {{slug: broken, displayName: Missing credentials, teams: [vision], cpu: 500m, memory: 1Gi}}
        roles:
          viewers: [department-heads]
          admins: [platform-admins]
        secrets:
          - name: wandb
            local: {{file: {places["secrets"]}, key: wandb}}
            profiles: [secure]
            teams: [vision]
          - name: hf
            local: {{file: {places["secrets"]}, key: hf}}
            profiles: [secure]
            teams: [vision]
            env: HF_TOKEN
          - name: gone
            local: {{file: {places["secrets"].parent / "missing.yaml"}, key: k}}
            profiles: [broken]
        data:
          - {{name: imagenet, teams: [vision], local: {{path: {places["data"] / "imagenet"}}}}}
          - {{name: scratch, teams: [vision], readOnly: false, local: {{path: {places["data"] / "scratch"}}}}}
          - {{name: corpora, teams: [nlp], local: {{path: {places["data"] / "corpora"}}}}}
        ray:
          enabled: true
    """)
    h = Hub(tmp_path_factory.mktemp("secrets-hub"), policy, slow_spawn_timeout=1)
    try:
        h.start(timeout=120)
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="module")
def users(hub):
    return {n: hub.login(n) for n in ("alice", "bob", "carol", "victor", "admin")}


def kernel(hub, user) -> KernelSession:
    s = user.wait_ready()
    return KernelSession("", hub.server_url(s["url"]), user.token, f"secrets-{uuid.uuid4().hex[:6]}.ipynb")


def started(hub, user, profile) -> KernelSession:
    if user.server() is not None:
        user.stop()
        user.wait_gone()
    r = user.start(profile)
    assert r.status_code in (201, 202), r.text
    return kernel(hub, user)


def server_pid(hub, name: str) -> int:
    for pid in processes_with_env(f"GPUHUB_TEST_RUN={hub.run_id}"):
        try:
            env = dict(i.split("=", 1) for i in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in i)
        except OSError:
            continue
        if env.get("JUPYTERHUB_USER") == name and "JUPYTERHUB_SERVICE_URL" in env:
            return pid
    raise LookupError(f"no server process of {name}")


def run_job(user, argv: list[str], profile: str = "secure", timeout: float = 120) -> tuple[dict, str]:
    spec = f"profile: {profile}\ncommand: {json.dumps(argv)}\n"
    r = user.api.post(user.url("/gpuhub/jobs"), json={"spec": spec, "filename": "secrets.yaml"})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    rec = wait_for(
        lambda: (
            (j := user.api.get(user.url(f"/gpuhub/jobs/{job_id}")).json())["state"] in ("succeeded", "failed", "cancelled") and j
        ),
        timeout,
        f"{job_id} to end",
    )
    return rec, user.api.get(user.url(f"/gpuhub/jobs/{job_id}/logs")).json()["text"]


READ_IN_JOB = (
    "import hashlib, os; d = os.environ['GPUHUB_SECRETS_DIR']; "
    "print('wandb', hashlib.sha256(open(d + '/wandb', 'rb').read()).hexdigest()); "
    "print('hf', hashlib.sha256(os.environ['HF_TOKEN'].encode()).hexdigest()); "
    "print('data', sorted(os.listdir(os.environ['GPUHUB_DATA_DIR'])))"
)

ATTACK = """\
import glob, os
found, tried = [], {{}}
def attempt(what, fn):
    try:
        tried[what] = repr(fn())[:80]
    except OSError as e:
        tried[what] = type(e).__name__
for v in {values!r}:
    for path in glob.glob('/proc/[0-9]*/environ'):
        try:
            if v.encode() in open(path, 'rb').read():
                found.append(path)
        except OSError:
            pass
attempt('own secrets dir', lambda: os.listdir('/run/gpuhub/secrets'))
attempt('own data dir', lambda: sorted(os.listdir('/run/gpuhub/data')))
attempt('her environ', lambda: open('/proc/{pid}/environ', 'rb').read())
attempt('her root', lambda: open('/proc/{pid}/root/run/gpuhub/secrets/wandb').read())
attempt('her cwd', lambda: os.listdir('/proc/{pid}/cwd'))
attempt('the admin file', lambda: open({secrets!r}).read())
attempt('the admin dir', lambda: os.listdir({etc!r}))
attempt('imagenet on the host', lambda: os.listdir({imagenet!r}))
attempt('imagenet readme on the host', lambda: open({imagenet!r} + '/README').read())
# Controls: the same probes do find what this account may read (its own environment; a
# world-readable file of the machine), so a "not found" above is the wall, not a broken probe.
own = os.environ['JUPYTERHUB_API_TOKEN'].encode()
def readable(path):
    try:
        return open(path, 'rb').read()
    except OSError:
        return b''
tried['control: own environ'] = any(own in readable(p) for p in glob.glob('/proc/[0-9]*/environ'))
attempt('control: a readable file', lambda: len(open('/etc/passwd').read()) > 0)
print(repr((found, tried)))
"""


def attack(k: KernelSession, places, pid: int, values: tuple[str, ...] = VALUES) -> tuple[list, dict]:
    out = k.execute(
        ATTACK.format(
            values=values,
            pid=pid,
            secrets=str(places["secrets"]),
            etc=str(places["secrets"].parent),
            imagenet=str(places["data"] / "imagenet"),
        )
    )
    found, tried = eval(out.strip())  # the kernel printed two literals
    return found, tried


def assert_walled_off(name: str, found: list, tried: dict, own_data: str) -> None:
    """What ``attack`` found from ``name``'s kernel: nothing of anyone else's."""
    assert found == [], f"{name} found a secret in {found}"
    assert tried["own secrets dir"] == "FileNotFoundError", tried  # nothing granted to them
    assert tried["own data dir"] == own_data, tried
    for what in ("her environ", "her root", "her cwd", "the admin file", "the admin dir", "imagenet on the host"):
        assert tried[what] in ("FileNotFoundError", "PermissionError"), (name, what, tried[what])
    assert tried["imagenet readme on the host"] in ("FileNotFoundError", "PermissionError"), tried
    assert tried["control: own environ"] is True and tried["control: a readable file"] == "True", tried


def test_alice_reads_her_granted_secrets_and_team_data_only_as_herself(hub, users, places):
    alice = users["alice"]
    k = started(hub, alice, "secure")
    try:
        out = k.execute(
            "import os, stat, pwd\n"
            "p = os.environ['GPUHUB_SECRETS_DIR'] + '/wandb'\n"
            "st = os.stat(p)\n"
            "print(open(p).read() == %r, os.environ.get('HF_TOKEN') == %r, oct(stat.S_IMODE(st.st_mode)), st.st_uid == os.getuid())\n"
            "print(sorted(os.listdir(os.environ['GPUHUB_DATA_DIR'])), open('/run/gpuhub/data/imagenet/README').read().strip())\n"
            "try:\n    open('/run/gpuhub/data/imagenet/mine', 'w')\nexcept OSError as e:\n    print('imagenet', e.errno)\n"
            "open('/run/gpuhub/data/scratch/from-alice', 'w').write('hello')\n"
            "try:\n    open(p, 'w')\nexcept OSError as e:\n    print('secret', e.errno)\n" % (WANDB, HF)
        )
    finally:
        k.close()
    lines = out.strip().splitlines()
    assert lines[0] == "True True 0o400 True", out
    assert lines[1] == "['imagenet', 'scratch'] vision's images", out  # not NLP's corpora
    assert "imagenet 30" in lines  # EROFS: read-only, as the policy says
    assert any(line.startswith("secret ") for line in lines)  # not even she can change it
    written = places["data"] / "scratch" / "from-alice"
    assert written.read_text() == "hello" and written.stat().st_uid != 0  # her account's file
    # The audit trail says what her server received, by name and how; never a value.
    admin = users["admin"]
    entries = admin.api.get(admin.url("/gpuhub/audit"), params={"event": "secrets_delivered", "user": "alice"}).json()["entries"]
    mine = [e for e in entries if e["key"] == "alice/"]
    assert mine and mine[-1]["names"] == ["wandb", "hf"], entries
    assert mine[-1]["delivered_as"] == {"wandb": "file", "hf": "env HF_TOKEN"}


def test_other_users_reach_none_of_it(hub, users, places):
    alice, bob, carol = users["alice"], users["bob"], users["carol"]
    started(hub, alice, "secure").close()
    pid = server_pid(hub, "alice")
    # bob: her team, a profile without the secrets; carol: another team, the same profile.
    for user, profile, own_data in ((bob, "cpu", "['imagenet', 'scratch']"), (carol, "secure", "['corpora']")):
        k = started(hub, user, profile)
        try:
            found, tried = attack(k, places, pid)
        finally:
            k.close()
        assert_walled_off(user.name, found, tried, own_data)
    # bob's own token against alice's server: refused before her process sees it.
    import requests

    s = alice.server()
    r = requests.get(
        hub.server_url(s["url"]) + "api/contents/", headers={"Authorization": f"token {bob.token}"}, allow_redirects=False
    )
    assert r.status_code in (302, 403), r.status_code


def test_jobs_get_them_and_a_rotation_reaches_the_next_job_without_a_restart(hub, users, places):
    alice, bob = users["alice"], users["bob"]
    rec, log = run_job(alice, ["python", "-c", READ_IN_JOB])
    assert rec["state"] == "succeeded", (rec, log)
    assert f"wandb {sha(WANDB)}" in log and f"hf {sha(HF)}" in log and "data ['imagenet', 'scratch']" in log, log
    # bob cannot read her job's record or log; her own record holds no value
    assert bob.api.get(bob.url(f"/gpuhub/jobs/{rec['id']}")).status_code in (403, 404)
    assert bob.api.get(bob.url(f"/gpuhub/jobs/{rec['id']}/logs")).status_code in (403, 404)
    record = alice.api.get(alice.url(f"/gpuhub/jobs/{rec['id']}")).text
    assert not any(v in record for v in VALUES)

    hub_pid = hub.proc.pid
    places["secrets"].write_text(f"wandb: {ROTATED}\nhf: {HF}\n")
    try:
        rec2, log2 = run_job(alice, ["python", "-c", READ_IN_JOB])
    finally:
        places["secrets"].write_text(f"wandb: {WANDB}\nhf: {HF}\n")  # as the other tests expect it
    assert rec2["state"] == "succeeded" and f"wandb {sha(ROTATED)}" in log2, log2
    assert hub.proc.pid == hub_pid and hub.proc.poll() is None  # the same hub, never restarted

    audit = users["admin"].api.get(users["admin"].url("/gpuhub/audit"), params={"event": "secrets_delivered"}).json()
    entries = audit["entries"] if isinstance(audit, dict) else audit
    keys = {e.get("key"): e for e in entries if e.get("event") == "secrets_delivered"}
    job_entry = keys.get(f"job:{rec['id']}")
    assert job_entry and job_entry["user"] == "alice" and job_entry["names"] == ["wandb", "hf"], entries
    data_entries = users["admin"].api.get(users["admin"].url("/gpuhub/audit"), params={"event": "data_mounted"}).json()
    mounted = {e["key"]: e for e in data_entries["entries"]}
    assert mounted[f"job:{rec['id']}"]["datasets"] == {"imagenet": "read-only", "scratch": "read-write"}, data_entries


def test_no_value_in_any_page_record_log_or_file_of_the_hub(hub, users, places):
    alice = users["alice"]
    if alice.server() is None:
        started(hub, alice, "secure").close()
    victor, admin = users["victor"], users["admin"]
    pages = [
        (admin, "/hub/gpuhub/policy"),
        (admin, "/hub/api/gpuhub/policy"),
        (admin, "/hub/gpuhub/audit"),
        (admin, "/hub/api/gpuhub/audit"),
        (admin, "/hub/api/gpuhub/jobs"),
        (admin, "/hub/gpuhub/usage"),
        (victor, "/hub/gpuhub/usage"),
        (victor, "/hub/gpuhub/policy"),
        (victor, "/hub/api/gpuhub/jobs"),
        (victor, "/hub/api/users/alice"),
        (admin, "/hub/api/users/alice"),
    ]
    seen = []
    for user, path in pages:
        r = user.api.get(hub.url + path)
        seen.append((user.name, path, r.status_code))
        assert not any(v in r.text for v in VALUES), (user.name, path)
    assert any(code == 200 for _, _, code in seen), seen  # the pages answered something
    # The hub's log (DEBUG) and every file under its data directory (database, audit, usage,
    # job records and logs, policy versions), the policy itself included.
    leaks = []
    for path in [hub.log, hub.policy, *hub.data.rglob("*")]:
        if path.is_file() and not path.is_symlink() and "/home/" not in str(path):
            data = path.read_bytes()
            leaks += [str(path) for v in VALUES if v.encode() in data]
    assert leaks == []


def test_a_secret_that_cannot_be_read_stops_the_start_and_says_where(hub, users):
    bob = users["bob"]
    if bob.server() is not None:
        bob.stop()
        bob.wait_gone()
    bob.start("broken")
    events = bob.progress(timeout=60)
    failed = [e for e in events if e.get("failed")]
    assert failed and "secret or dataset its profile is granted is not available" in failed[-1]["message"], events
    line = "Cannot start bob: a granted secret or dataset: secrets[2] (gone).local.file"
    wait_for(lambda: line in hub.log.read_text(errors="replace"), 30, "the located reason in the log")
    assert "missing.yaml does not exist" in hub.log.read_text(errors="replace")
    # ... which the policy's checks said when it loaded (admins see it on the status page)
    assert "Policy" in hub.log.read_text(errors="replace") and "is live, but:" in hub.log.read_text(errors="replace")


def ray_cli(hub, user, *args) -> str:
    """``gpuhub ray ...`` from a laptop, with a token from the token page."""
    import subprocess
    import sys

    e = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "GPUHUB_TOKEN"))}
    e.update(GPUHUB_TOKEN=user.token)
    r = subprocess.run(
        [sys.executable, "-m", "gpuhub_spawner.cli", "ray", "--hub", hub.url, *args], capture_output=True, text=True, env=e
    )
    assert r.returncode == 0, r.stdout + r.stderr + hub.tail(40)
    return r.stdout


def cluster_pids(hub, user: str, cluster: str) -> list[int]:
    """As root: the processes of ``user``'s Ray cluster ``cluster`` (its job's sandbox), oldest first."""
    from gpuhub_spawner.local.unix_users import system_username
    import pwd

    uid = pwd.getpwnam(system_username(user, hub.env["GPUHUB_ACCOUNT_PREFIX"])).pw_uid
    return sorted(p for p in processes_with_env(f"GPUHUB_RAY_CLUSTER={cluster}") if os.stat(f"/proc/{p}").st_uid == uid)


RAY_TASK = """\
import errno, hashlib, os, stat, ray
ray.init({address!r}, log_to_driver=False)
@ray.remote
def look():
    p = os.environ["GPUHUB_SECRETS_DIR"] + "/wandb"
    st = os.stat(p)
    try:
        open("/run/gpuhub/data/imagenet/from-ray", "w")
        wrote = "written"
    except OSError as e:
        wrote = errno.errorcode[e.errno]
    return {{"wandb": hashlib.sha256(open(p, "rb").read()).hexdigest(), "mode": oct(stat.S_IMODE(st.st_mode)),
            "own": st.st_uid == os.getuid(), "hf": hashlib.sha256(os.environ.get("HF_TOKEN", "").encode()).hexdigest(),
            "data": sorted(os.listdir(os.environ["GPUHUB_DATA_DIR"])), "imagenet": wrote,
            "cgroup": open("/proc/self/cgroup").read().strip()}}
print(repr(ray.get(look.remote(), timeout=300)))
ray.shutdown()
"""


def on(hub, user, profile) -> KernelSession:
    """A kernel of ``user``'s server on ``profile``: the running one if it has that profile."""
    s = user.server()
    if s is not None and s.get("ready") and (s.get("user_options") or {}).get("profile") == profile:
        return kernel(hub, user)
    return started(hub, user, profile)


def test_a_ray_cluster_gets_her_grants_as_her_jobs_do_and_another_team_reaches_none(hub, users, places):
    """docs/secrets-and-data.md: a Ray cluster is a job of its owner (``gpuhub ray up``), so it
    gets the profile's and team's grants; carol (NLP) gets none of Vision Lab's, neither in her
    own cluster nor from her kernel against alice's cluster's processes."""
    pytest.importorskip("ray", reason="the ray extra (pip install -e '.[ray]')")
    alice, carol = users["alice"], users["carol"]
    # Their servers first: a Ray head starting takes the machine's CPUs for a minute.
    k_alice, k_carol = on(hub, alice, "secure"), on(hub, carol, "secure")
    # alice's smallest cluster (a head, no GPU); what needs no running head is done while it starts.
    ray_cli(hub, alice, "up", "--profile", "secure", "--name", "vault", "--no-wait")
    try:
        # carol's, on the same profile: looked at as root in its own mount namespace as soon as
        # its sandbox runs, then stopped (its head need not be up).
        ray_cli(hub, carol, "up", "--profile", "secure", "--name", "theirs", "--no-wait")
        try:
            pid = wait_for(lambda: (c := cluster_pids(hub, "carol", "theirs")) and c[0], 120, "carol's cluster's processes")
            root = Path(f"/proc/{pid}/root/run/gpuhub")
            assert not (root / "secrets").exists() and sorted(os.listdir(root / "data")) == ["corpora"]
            assert not any(v.encode() in Path(f"/proc/{pid}/environ").read_bytes() for v in VALUES)
        finally:
            ray_cli(hub, carol, "down", "theirs")

        # From carol's seat (her kernel, her account) against alice's cluster's processes: their
        # environment (her secret, her Ray token), the secret tmpfs through /proc/<pid>/root.
        target = wait_for(lambda: (c := cluster_pids(hub, "alice", "vault")) and c[0], 120, "alice's cluster's processes")
        token = (hub.data / "ray" / "tokens" / "alice").read_text().strip()
        try:
            found, tried = attack(k_carol, places, target, VALUES + (token,))
        finally:
            k_carol.close()
        assert_walled_off("carol", found, tried, "['corpora']")

        # alice's own: a Ray task in it reads her secret file (hers alone, 0400), her HF_TOKEN,
        # her team's datasets; imagenet is read-only there too.
        try:
            cluster = wait_for(
                lambda: (v := alice.api.get(alice.url("/gpuhub/ray/vault")).json())["state"] not in ("queued", "starting") and v,
                420,
                "alice's Ray head to run",
            )
            assert cluster["state"] == "running", cluster
            seen = eval(k_alice.execute(RAY_TASK.format(address=cluster["address"]), timeout=300).strip().splitlines()[-1])
        finally:
            k_alice.close()
        assert seen["wandb"] == sha(WANDB) and seen["mode"] == "0o400" and seen["own"], seen
        assert seen["hf"] == sha(HF) and seen["data"] == ["imagenet", "scratch"] and seen["imagenet"] == "EROFS", seen
        assert cluster["id"] in seen["cgroup"], seen  # it ran in the cluster's sandbox, not in her server
        admin = users["admin"]
        entries = admin.api.get(admin.url("/gpuhub/audit"), params={"event": "secrets_delivered", "user": "alice"}).json()
        assert any(e["key"] == f"job:{cluster['id']}" and e["names"] == ["wandb", "hf"] for e in entries["entries"]), entries
    finally:
        ray_cli(hub, alice, "down", "vault")
