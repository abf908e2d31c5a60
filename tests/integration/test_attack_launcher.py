"""Attacks on the root sandbox launcher, against a real hub run as root (issue 19, items 1 and 5).

The launcher (``python -I -m gpuhub_spawner.local.sandbox``) runs as root until it drops
to the user's account; whatever of the user's reaches it before that runs as root.

- A user's own shared library (compiled with gcc by a job of theirs, in their home) named
  in ``LD_PRELOAD`` must never run as root, whichever road the variable takes: the job
  file's ``env`` (the reviewer's attack; the job-file wall may refuse it first) and the
  server's configured environment (no wall: only the launcher can keep it from root).
  The library prints its uid from a constructor; no line may say uid 0.
- The launcher's own ``execve``, traced with strace: its environment is exactly the
  fixed one and its argv carries neither the spec nor a secret; the server's/job's
  environment appears only in the final ``execve`` (as the user).
- A link the user planted in their private /tmp must not make root create or mount
  anything outside it. The hub runs from a Python whose environment sits under /tmp
  (a venv reached through /tmp, as a lab might keep one), so the sandbox has to put it
  back inside the private /tmp, as root, at the path the user controls.

Accounts and cgroups get this hub's own prefix and are removed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from support.hub import Hub, wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher is only privileged in a hub running as root"),
]

MARK = "attack-" + uuid.uuid4().hex[:8]
LIBRARY = textwrap.dedent(f"""\
    #include <stdio.h>
    #include <unistd.h>
    __attribute__((constructor)) static void gpuhub_attack(void) {{
        fprintf(stderr, "[{MARK}] uid=%d euid=%d\\n", (int)getuid(), (int)geteuid());
    }}
""")
# The launcher's whole environment while it is root (local.sandbox.LAUNCHER_ENV).
FIXED_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
POLICY = """\
teams:
  - {name: vision, displayName: Vision Lab, groups: [vision-lab]}
  - {name: nlp, displayName: NLP, groups: [nlp-group]}
profiles:
  - {slug: cpu, displayName: CPU only, teams: "*", default: true, cpu: 500m, memory: 1Gi}
"""


def preload_lines(text: str) -> list[tuple[int, int]]:
    """(uid, euid) of every process the library ran in, from its lines in ``text``."""
    out = []
    for line in text.splitlines():
        if f"[{MARK}] uid=" in line:
            uid, euid = line.split(f"[{MARK}] ", 1)[1].split()[:2]
            out.append((int(uid.split("=")[1]), int(euid.split("=")[1])))
    return out


@pytest.fixture(scope="module")
def python_under_tmp():
    """This venv reached through /tmp: the hub's ``sys.prefix`` is then under /tmp."""
    d = tempfile.mkdtemp(prefix="gpuhub-attack-venv-", dir="/tmp")
    os.chmod(d, 0o755)
    os.symlink(sys.prefix, os.path.join(d, "venv"))
    python = os.path.join(d, "venv", "bin", "python")
    prefix = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True).stdout.strip()
    if prefix != os.path.join(d, "venv"):
        shutil.rmtree(d)
        pytest.skip(f"a venv reached through a link does not keep its path here (sys.prefix {prefix!r})")
    yield d, python
    shutil.rmtree(d)


@pytest.fixture(scope="module")
def hub(tmp_path_factory, python_under_tmp):
    _, python = python_under_tmp
    h = Hub(tmp_path_factory.mktemp("attack"), POLICY)
    h.prefix = h.env["GPUHUB_ACCOUNT_PREFIX"]
    # The road without a wall: the server's configured environment (carol's only).
    h.preload_for_carol = f"{h.data / 'home' / 'carol' / 'p.so'} /home/{h.prefix}carol/p.so"
    h.config.write_text(
        h.config.read_text()
        + textwrap.dedent(f"""\
        _preload = {{"carol": {h.preload_for_carol!r}}}
        c.Spawner.environment = dict(c.Spawner.environment,
                                     LD_PRELOAD=lambda spawner: _preload.get(spawner.user.name, ""))
    """)
    )
    real = sys.executable
    sys.executable = python  # Hub.start runs [sys.executable, "-m", "jupyterhub", ...]
    try:
        h.start(timeout=90)
    finally:
        sys.executable = real
    try:
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="module")
def users(hub):
    return {n: hub.login(n) for n in ("alice", "bob", "carol", "lena")}


def submit(user, spec: str):
    return user.api.post(user.url("/gpuhub/jobs"), json={"spec": spec, "filename": "attack.yaml"})


def run_job(user, spec: str, timeout: float = 120) -> tuple[dict, str]:
    r = submit(user, spec)
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


def job_file(argv: list[str], env: dict | None = None) -> str:
    text = "profile: cpu\ncommand: " + json.dumps(argv) + "\n"  # JSON is YAML
    if env:
        text += "env: " + json.dumps(env) + "\n"
    return text


def compile_library(user) -> str:
    """The user's job compiles the library into their home; returns the home's host path,
    read from the job's own /proc/self/mountinfo as an attacker would."""
    if not shutil.which("gcc"):
        pytest.skip("gcc is not installed: the attack library cannot be built")
    code = textwrap.dedent(f"""\
        import os, subprocess
        home = os.environ["HOME"]
        open(home + "/p.c", "w").write({LIBRARY!r})
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", home + "/p.so", home + "/p.c"], check=True)
        for line in open("/proc/self/mountinfo"):
            f = line.split()
            if f[4] == home:
                print("HOSTHOME", f[3])
    """)
    rec, log = run_job(user, job_file([sys.executable, "-c", code]))
    assert rec["state"] == "succeeded", log
    return log.split("HOSTHOME ", 1)[1].split()[0]


def test_a_library_named_in_a_job_files_env_never_runs_as_root(hub, users):
    """The reviewer's attack: LD_PRELOAD in the job file, the library in bob's own home."""
    bob = users["bob"]
    host_home = compile_library(bob)
    account = f"{hub.prefix}bob"
    uid = int(subprocess.run(["id", "-u", account], capture_output=True, text=True, check=True).stdout)
    spec = job_file(["/usr/bin/id", "-u"], env={"LD_PRELOAD": f"{host_home}/p.so /home/{account}/p.so"})
    r = submit(bob, spec)
    if r.status_code == 400:  # the job-file wall (jobs/spec.py) refuses it before anything runs
        assert "LD_PRELOAD" in r.text, r.text
        return
    rec, log = run_job(bob, spec)
    ran = preload_lines(log)
    assert all(0 not in ids for ids in ran), f"the user's library ran as root:\n{log}"
    assert (uid, uid) in ran, log  # the job's own processes got their environment


def test_a_library_in_the_servers_environment_never_runs_as_root(hub, users):
    """No wall on this road (the hub's configured environment): only the launcher keeps
    carol's library from root, for her server and for her job alike."""
    carol = users["carol"]
    compile_library(carol)
    uid = int(subprocess.run(["id", "-u", f"{hub.prefix}carol"], capture_output=True, text=True, check=True).stdout)
    before = len(hub.log.read_bytes())
    assert carol.start("cpu").status_code in (201, 202)
    carol.wait_ready()
    server_log = hub.log.read_bytes()[before:].decode(errors="replace")
    ran = preload_lines(server_log)
    assert all(0 not in ids for ids in ran), f"carol's library ran as root when her server started:\n{server_log[-3000:]}"
    assert (uid, uid) in ran  # ...and in her server's own processes
    assert carol.server_env()["LD_PRELOAD"] == hub.preload_for_carol
    rec, log = run_job(carol, job_file(["/bin/true"]))
    ran = preload_lines(log)
    assert all(0 not in ids for ids in ran), f"carol's library ran as root when her job started:\n{log}"
    assert (uid, uid) in ran, log
    carol.stop()
    carol.wait_gone()


def _strings(text: str, i: int) -> tuple[list[str], int]:
    """Parse strace's ``["a", "b\\n"]`` at ``text[i]``: the strings and the index after ``]``."""
    assert text[i] == "[", text[i : i + 40]
    out, i = [], i + 1
    while text[i] != "]":
        if text[i] in ", ":
            i += 1
            continue
        assert text[i] == '"', text[i : i + 40]
        i += 1
        buf = []
        while text[i] != '"':
            if text[i] == "\\":
                nxt = text[i + 1]
                if nxt in "01234567":
                    j = i + 1
                    while j < i + 4 and text[j] in "01234567":
                        j += 1
                    buf.append(chr(int(text[i + 1 : j], 8)))
                    i = j
                    continue
                buf.append({"n": "\n", "t": "\t", "r": "\r", "v": "\v", "f": "\f"}.get(nxt, nxt))
                i += 2
                continue
            buf.append(text[i])
            i += 1
        out.append("".join(buf))
        i += 1
    return out, i + 1


def execves(path: Path) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, env) of each successful execve in one strace -ff output file."""
    found = []
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("execve(") or not line.rstrip().endswith("= 0"):
            continue
        start = line.index("[")
        argv, i = _strings(line, start)
        env, _ = _strings(line, line.index("[", i))
        found.append((argv, dict(e.split("=", 1) for e in env if "=" in e)))
    return found


def launches(trace_dir: Path) -> list[list[tuple[list[str], dict[str, str]]]]:
    """Per process that ran the sandbox launcher: its execves (the launcher's, then the user's)."""
    out = []
    for f in trace_dir.iterdir():
        calls = execves(f)
        if calls and "gpuhub_spawner.local.sandbox" in calls[0][0]:
            out.append(calls)
    return out


def test_the_root_launcher_gets_a_fixed_environment_and_no_secret_on_argv(hub, users, tmp_path):
    if not shutil.which("strace"):
        pytest.skip("strace is not installed: the launcher's execve cannot be observed")
    alice = users["alice"]
    trace = tmp_path / "trace"
    trace.mkdir()
    err = open(tmp_path / "strace.err", "w+")
    strace = subprocess.Popen(
        ["strace", "-f", "-ff", "-v", "-s", "1048576", "-e", "trace=execve", "-o", str(trace / "t"), "-p", str(hub.proc.pid)],
        stderr=err,
    )
    try:
        wait_for(lambda: "attached" in (tmp_path / "strace.err").read_text(), 30, "strace to attach to the hub")
        assert alice.start("cpu").status_code in (201, 202)
        # Seen: the launcher's execve and then, in the same process, the server's own.
        wait_for(lambda: any(len(c) >= 2 for c in launches(trace)), 120, "the server's execve in the trace")
        marker = f"job-secret-{uuid.uuid4().hex}"
        r = submit(alice, job_file(["/bin/true"], env={"ALICE_SECRET": marker}))
        assert r.status_code == 201, r.text
        wait_for(
            lambda: any(len(c) >= 2 and c[1][1].get("ALICE_SECRET") == marker for c in launches(trace)),
            120,
            "the job's execve in the trace",
        )
    finally:
        strace.terminate()  # detaches from the hub and its children
        try:
            strace.wait(120)  # detaching from every traced thread took over 30 s once at load ~10
        except subprocess.TimeoutExpired:
            strace.kill()  # SIGKILL: the kernel detaches it from every tracee
            strace.wait(30)
        err.close()
    alice.wait_ready()
    seen = launches(trace)
    server = [c for c in seen if len(c) >= 2 and "JUPYTERHUB_API_TOKEN" in c[1][1]]
    job = [c for c in seen if len(c) >= 2 and c[1][1].get("ALICE_SECRET") == marker]
    assert server and job, [c[-1][0][:4] for c in seen]
    for (argv, env), (_user_argv, user_env) in (server[0][:2], job[0][:2]):
        # As root: the fixed environment only, and nothing secret or user-given on argv.
        assert env == FIXED_ENV, env
        secrets = [user_env.get("JUPYTERHUB_API_TOKEN"), user_env.get("ALICE_SECRET"), hub.run_id]
        assert not any(s and s in " ".join(argv) for s in secrets), argv
        assert not any(a.lstrip().startswith("{") for a in argv), argv  # no JSON spec on argv
        # The user's environment arrives only with the final execve (after the switch).
        assert user_env["GPUHUB_TEST_RUN"] == hub.run_id and user_env["HOME"].startswith("/home/")
    alice.stop()
    alice.wait_gone()


@pytest.mark.parametrize("plant", ["link", "nested-link"])
def test_a_link_planted_in_the_private_tmp_is_not_followed_by_root(hub, users, python_under_tmp, plant):
    """lena leaves a link in her private /tmp where the sandbox puts the venv back.

    link: ``/tmp/<venv dir> -> /var/lib/<victim>``: root would make ``<victim>/venv`` on
    the host. nested-link: ``/tmp/<venv dir>/venv -> /var/lib/<victim>``: root would mount
    the venv over the victim in her mount namespace. Either way: refused, nothing made.
    """
    from gpuhub_spawner.local.unix_users import ensure_account

    venv_dir, _ = python_under_tmp
    lena = users["lena"]
    account = ensure_account("lena", hub.prefix)
    victim = tempfile.mkdtemp(prefix="gpuhub-attack-victim-", dir="/var/lib")
    private = Path("/tmp/gpuhub") / account.name  # the hub's default tmp_dir_template
    planted = private / os.path.basename(venv_dir)
    try:
        os.makedirs(private.parent, mode=0o700, exist_ok=True)
        private.mkdir(exist_ok=True)
        os.chown(private, account.uid, account.gid)  # as an earlier server left it: hers, 1777
        os.chmod(private, 0o1777)
        if plant == "link":
            os.symlink(victim, planted)
            os.lchown(planted, account.uid, account.gid)
        else:
            planted.mkdir()
            os.chown(planted, account.uid, account.gid)
            os.symlink(victim, planted / "venv")
            os.lchown(planted / "venv", account.uid, account.gid)
        look = (
            f"import os\ntry:\n    print('VICTIM', sorted(os.listdir({victim!r})))\nexcept OSError as e:\n    print('VICTIM', e)"
        )
        rec, log = run_job(lena, job_file([sys.executable, "-c", look]))
        assert os.listdir(victim) == [], f"root made {os.listdir(victim)} in {victim} through lena's link"
        assert "pyvenv.cfg" not in log, f"root mounted the venv over {victim} through lena's link:\n{log}"
        assert rec["state"] == "failed" and "is a symbolic link or not a directory" in log, log
        st = os.lstat(private)
        assert (st.st_uid, st.st_mode & 0o7777) == (0, 0o1777)  # root's now, sticky like /tmp
    finally:
        if os.path.islink(planted):
            os.unlink(planted)
        elif planted.exists():
            shutil.rmtree(planted)
        shutil.rmtree(victim, ignore_errors=True)
