"""A notebook as a job (issue 44) against a real hub run as root: papermill executes the
notebook top to bottom as its user, in the team's queue, with parameters; the executed
notebook opens from the jobs page for its owner only; a failed cell fails the job with the
cell and its traceback; a preempted notebook resumes from its checkpoint; ``--stop-server``
frees the interactive GPU for the job.

One hub for the module (its own account prefix and data directory: tests/support/hub.py);
virtual GPUs stand in for NVML.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from support.hub import Hub, wait_for
from support.jobs import logs, wait_state
from support.kernel import KernelSession
from support.notebooks import notebook, put_notebook
from support.policies import jobs_policy

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="jobs run as their user's account: needs a hub running as root"),
]

POLICY = jobs_policy(
    teams="""\
  - {name: nlp, displayName: NLP, groups: [nlp-group], quota: {gpus: {gpu: 0}}}
""",
    profiles="""\
  - {slug: cpu, displayName: CPU only, teams: "*", default: true, cpu: "1", memory: 1Gi}
  - {slug: gpu-1, displayName: One GPU, gpu: {count: 1, flavor: gpu}, teams: [vision], cpu: "1", memory: 1Gi}
""",
)


TRAIN = notebook(
    ("parameters", "lr = 0.5\nsteps = 2"),
    "import os, json\nprint(f'lr {lr} steps {steps} uid {os.getuid()}', flush=True)\n"
    "print(f\"ctx {os.environ['MLFLOW_RUN_CONTEXT']}\", flush=True)",
    "print(f\"has server token {'JPY_API_TOKEN' in os.environ} cwd {os.getcwd()}\")",
)

FAILING = notebook(
    "x = 1\nprint('first cell ran')",
    "raise ValueError(f'learning rate {x} is too large')",
    "print('never printed')",
)

# Checkpoints every step, atomically; resumes from the last one (the notebook reads its checkpoint).
# The first attempt waits at step 2 to be preempted: the preemption the test brings never races
# that attempt's own end (2.4 s after step 2, which a loaded machine's look at the log, the
# teammate's start and the hub's reaction can spend).
RESUMING = notebook(
    ("parameters", "last = 8"),
    textwrap.dedent("""\
        import json, os, time
        ckpt = os.path.join(os.environ["GPUHUB_CHECKPOINT_DIR"], "state.json")
        state = {"step": 0, "total": 0}
        if os.path.exists(ckpt):
            state = json.load(open(ckpt))
            print(f"resumed from step {state['step']} attempt {os.environ['GPUHUB_ATTEMPT']}", flush=True)
        print(f"attempt {os.environ['GPUHUB_ATTEMPT']} starts after step {state['step']}", flush=True)"""),
    textwrap.dedent("""\
        for step in range(state["step"] + 1, last + 1):
            time.sleep(0.4)
            state = {"step": step, "total": state["total"] + step}
            json.dump(state, open(ckpt + ".tmp", "w")); os.replace(ckpt + ".tmp", ckpt)
            print(f"step {step}", flush=True)
            if step == 2 and os.environ["GPUHUB_ATTEMPT"] == "1":
                time.sleep(300)  # preempted long before (bounded: nothing outlives the test)"""),
    "print(f\"total {state['total']}\")",
)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("nbjobs"), POLICY)
    h.prefix = h.env["GPUHUB_ACCOUNT_PREFIX"]
    try:
        h.start()
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="module")
def users(hub):
    return {n: hub.login(n) for n in ("alice", "bob", "carol", "admin")}


def cli(hub, user, *args, check=True):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "GPUHUB_TOKEN"))}
    e.update(GPUHUB_TOKEN=user.token)
    r = subprocess.run(
        [sys.executable, "-m", "gpuhub_spawner.cli", "job", "--hub", hub.url, *args],
        capture_output=True,
        text=True,
        env=e,
        timeout=60,
    )
    if check:
        assert r.returncode == 0, r.stderr
    return r


def submit(hub, user, rel, *args) -> str:
    return cli(hub, user, "submit", rel, "--home-path", *args).stdout.strip().splitlines()[-1]


def executed(user, job_id, attempt=None):
    return user.api.get(user.url(f"/gpuhub/jobs/{job_id}/notebook" + (f"?attempt={attempt}" if attempt else "")))


def outputs(nb: dict) -> str:
    return "".join(
        "".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "stream"
    )


def test_a_notebook_runs_as_a_job_with_its_parameters_and_its_executed_notebook_opens_for_its_owner_only(hub, users):
    bob, carol, admin = users["bob"], users["carol"], users["admin"]
    rel = put_notebook(hub, "bob", f"proj/train-{uuid.uuid4().hex[:6]}.ipynb", TRAIN)
    job_id = submit(hub, bob, rel, "--profile", "cpu", "-p", "lr=0.01", "-p", "steps=4", "--name", "nb")
    rec = wait_state(bob, job_id, "succeeded", "failed")
    out = logs(bob, job_id)
    assert rec["state"] == "succeeded", out
    # Executed top to bottom, as bob's account, the parameters injected after the tagged cell.
    account_uid = int(subprocess.run(["id", "-u", f"{hub.prefix}bob"], capture_output=True, text=True).stdout)
    assert f"lr 0.01 steps 4 uid {account_uid}" in out  # cell outputs reach the log as they come
    assert f'"gpuhub.job.id": "{job_id}", "gpuhub.job.attempt": "1"' in out  # its MLflow runs carry the job
    assert rec["kind"] == "notebook" and rec["notebook"] == {"path": rel, "parameters": {"lr": 0.01, "steps": 4}}
    assert rec["attempts"][0]["notebook"] == "attempt-1.ipynb" and rec["attempts"][0]["failed_cell"] is None
    # The executed notebook: a download for its owner, with the injected parameters and outputs.
    r = executed(bob, job_id)
    assert r.status_code == 200 and r.headers["Content-Disposition"].startswith("attachment")
    nb = r.json()
    tags = [c["metadata"].get("tags", []) for c in nb["cells"]]
    assert tags[:2] == [["parameters"], ["injected-parameters"]]
    assert "lr = 0.01" in "".join(nb["cells"][1]["source"])
    assert "has server token False" in outputs(nb) and f"cwd /home/{hub.prefix}bob/proj" in outputs(nb)
    # The jobs page links it; its page shows the cells and outputs.
    page = bob.session.get(f"{hub.url}/hub/gpuhub/jobs/{job_id}").text
    assert f"gpuhub/jobs/{job_id}/notebook?attempt=1" in page and f"~/{rel}" in page
    page = bob.session.get(f"{hub.url}/hub/gpuhub/jobs/{job_id}/notebook?attempt=1")
    assert page.status_code == 200 and "lr 0.01 steps 4" in page.text and "injected parameters" in page.text
    # Nobody else: not another user, not an admin (who may see the record), not by another route.
    for other in (carol, admin):
        assert executed(other, job_id).status_code == 404
        assert other.session.get(f"{hub.url}/hub/gpuhub/jobs/{job_id}/notebook").status_code == 404
    assert carol.api.get(carol.url(f"/gpuhub/jobs/{job_id}")).status_code == 404
    assert admin.api.get(admin.url(f"/gpuhub/jobs/{job_id}")).status_code == 200


def test_another_users_job_cannot_read_the_executed_notebook_or_the_notebook(hub, users):
    """From the other tenant's seat: carol's own job goes looking for bob's notebook files."""
    bob, carol = users["bob"], users["carol"]
    rel = put_notebook(hub, "bob", f"secret/nb-{uuid.uuid4().hex[:6]}.ipynb", notebook("print('bob private output')"))
    job_id = submit(hub, bob, rel, "--profile", "cpu")
    assert wait_state(bob, job_id, "succeeded", "failed")["state"] == "succeeded"
    stem = os.path.basename(rel)[: -len(".ipynb")]
    targets = [
        f"/home/{hub.prefix}bob/.gpuhub/jobs/{job_id}/{stem}.attempt-1.ipynb",
        f"/home/{hub.prefix}bob/{rel}",
        str(hub.data / "home" / "bob" / ".gpuhub" / "jobs" / job_id / f"{stem}.attempt-1.ipynb"),
        str(hub.data / "jobs" / job_id / "attempt-1.ipynb"),
    ]
    assert os.path.exists(targets[2]) and os.path.exists(targets[3])  # they exist; carol must not reach them
    probe = (
        "import sys\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        print('READ', p, open(p).read()[:40])\n"
        "    except OSError as e:\n"
        "        print('DENIED', p, type(e).__name__)\n"
    )
    spec = json.dumps({"profile": "cpu", "command": [sys.executable, "-c", probe, *targets]})
    r = carol.api.post(carol.url("/gpuhub/jobs"), json={"spec": spec, "filename": "probe.yaml"})
    assert r.status_code == 201, r.text
    probe_id = r.json()["id"]
    assert wait_state(carol, probe_id, "succeeded", "failed")["state"] == "succeeded"
    out = logs(carol, probe_id)
    assert out.count("DENIED") == len(targets) and "READ" not in out and "bob private output" not in out, out


def test_a_failed_cell_fails_the_job_with_the_cell_and_traceback_on_the_jobs_page(hub, users):
    bob = users["bob"]
    # (A notebook that names no kernel nor language, as some tools write them: the machine's Python runs it.)
    rel = put_notebook(
        hub, "bob", f"proj/failing-{uuid.uuid4().hex[:6]}.ipynb", json.dumps({**json.loads(FAILING), "metadata": {}})
    )
    job_id = submit(hub, bob, rel, "--profile", "cpu", "--retries", "2", "--retry-on", "preempted")
    rec = wait_state(bob, job_id, "failed", "succeeded")
    assert rec["state"] == "failed" and len(rec["attempts"]) == 1  # a failed cell is not retried unless asked
    fc = rec["attempts"][0]["failed_cell"]
    assert (fc["cell"], fc["ename"], fc["evalue"]) == (2, "ValueError", "learning rate 1 is too large")
    assert "raise ValueError" in fc["source"] and "ValueError" in fc["traceback"] and "\x1b[" not in fc["traceback"]
    assert rec["status"].startswith("failed: cell 2 failed: ValueError: learning rate 1 is too large")
    out = logs(bob, job_id)
    assert "first cell ran" in out and "never printed" not in out
    assert "[gpuhub] cell 2 (execution count 2) failed: ValueError" in out
    page = bob.session.get(f"{hub.url}/hub/gpuhub/jobs/{job_id}").text
    assert 'id="gpuhub-failed-cell-1"' in page and "cell 2 failed" in page
    assert "raise ValueError(f&#39;learning rate {x} is too large&#39;)" in page  # the source, escaped
    assert "ValueError: learning rate 1 is too large" in page
    # The executed notebook keeps the cells that ran and the error.
    assert "first cell ran" in outputs(executed(bob, job_id).json())


def test_a_preempted_notebook_resumes_from_its_checkpoint(hub, users):
    alice, bob = users["alice"], users["bob"]
    rel = put_notebook(hub, "bob", f"proj/resume-{uuid.uuid4().hex[:6]}.ipynb", RESUMING)
    job_id = submit(hub, bob, rel, "--profile", "gpu-1", "--name", "resume")
    wait_for(lambda: "step 2" in logs(bob, job_id), 90, "the notebook to reach step 2")
    # A teammate's interactive server takes the GPU back: the job is preempted and queued again.
    assert alice.start("gpu-1").status_code in (201, 202)
    alice.wait_ready()
    rec = wait_state(bob, job_id, "queued")
    assert rec["attempts"][0]["reason"] == "preempted"
    alice.stop()
    rec = wait_state(bob, job_id, "succeeded", "failed", timeout=120)
    out = logs(bob, job_id)
    assert [a["reason"] for a in rec["attempts"]] == ["preempted", "succeeded"], out
    second = executed(bob, job_id, 2).json()
    resumed = outputs(second)
    assert "resumed from step" in resumed and "attempt 2" in resumed and "total 36" in resumed  # 1+..+8 over both
    assert int(resumed.split("resumed from step")[1].split()[0]) >= 2
    assert "step 1\n" not in resumed  # nothing before the checkpoint ran again
    # The preempted attempt's executed notebook kept the cells that finished before the SIGTERM.
    first = executed(bob, job_id, 1).json()
    assert "attempt 1 starts after step 0" in outputs(first) and "total" not in outputs(first)
    assert "attempt 2 starts after step" in resumed
    alice.wait_gone()


def test_stop_server_frees_the_interactive_gpu_for_the_notebook_job(hub, users):
    """Submitted from a terminal of the server that holds the user's one GPU, with --stop-server."""
    alice = users["alice"]
    rel = put_notebook(hub, "alice", f"nb/move-{uuid.uuid4().hex[:6]}.ipynb", notebook("print('moved to a job')"))
    assert alice.start("gpu-1").status_code in (201, 202)
    s = alice.wait_ready()
    k = KernelSession("", hub.server_url(s["url"]), alice.token, f"nbjob-{uuid.uuid4().hex[:6]}.ipynb")
    try:
        out = k.execute(
            textwrap.dedent(f"""\
            import os, subprocess
            r = subprocess.run(["gpuhub", "job", "submit", os.path.expanduser("~/{rel}"), "--profile", "gpu-1", "--stop-server"],
                               capture_output=True, text=True)
            print(r.returncode, r.stderr.strip().replace("\\n", " | "))
            print(r.stdout)
        """)
        )
    except Exception:  # noqa: BLE001 - the server may be stopped under the kernel's answer
        out = ""
    finally:
        try:
            k.close()
        except Exception:  # noqa: BLE001
            pass
    alice.wait_gone(timeout=60)
    jobs = alice.api.get(alice.url("/gpuhub/jobs")).json()["jobs"]
    mine = [j for j in jobs if j.get("notebook") and j["notebook"]["path"] == rel]
    assert len(mine) == 1, (out, jobs)
    rec = wait_state(alice, mine[0]["id"], "succeeded", "failed")
    assert rec["state"] == "succeeded" and rec["attempts"][0]["devices"], logs(alice, rec["id"])
    assert "moved to a job" in logs(alice, rec["id"])
