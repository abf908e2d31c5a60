"""A team's nominal quota comes back (issue 14), against a real hub run with real servers.

Two teams in one cohort, one GPU of nominal quota each, two (virtual) GPUs on the machine.
Vision borrows NLP's idle GPU; when NLP asks for it: a borrowing *job* is preempted at once
and re-queued; a borrowing *server* is warned where cull warnings are shown (API, home
page) and stopped after NLP's ``reclaim.notice`` (10 s here, the culler passing every 2 s:
production's 10 min notice and 60 s pass, one unit smaller and then some), and the NLP request
is admitted in the same event. A lender that stops asking withdraws the warning (an idle cohort keeps lending).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from support.browser import CHROMIUM, chromium, log_in, wait_lab_whole
from support.hub import running_hub, wait_for

pytestmark = pytest.mark.integration

NOTICE = 10
PASS = 2

POLICY = f"""\
flavors:
  - name: gpu
    displayName: Tesla
    local: {{virtual: 2}}
priorityClasses:
  - {{name: interactive, value: 1000}}
  - {{name: batch, value: 100}}
teams:
  - name: vision
    displayName: Vision Lab
    groups: [vision-lab]
    cohort: lab
    defaultPriority: interactive
    jobPriority: batch
    quota: {{gpus: {{gpu: 1}}}}
  - name: nlp
    displayName: NLP Group
    groups: [nlp-group]
    cohort: lab
    defaultPriority: interactive
    jobPriority: batch
    quota: {{gpus: {{gpu: 1}}}}
    reclaim: {{notice: {NOTICE}s}}
profiles:
  - {{slug: gpu-1, displayName: One GPU, gpu: {{count: 1, flavor: gpu}}, teams: "*", cpu: 500m, memory: 1Gi}}
defaults:
  queueTimeout: 5m
  idle: {{timeout: 1h, gpuIdleTimeout: 1h, warning: 5m}}
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with running_hub(
        tmp_path_factory.mktemp("reclaim"), POLICY, env={"GPUHUB_CULL_EVERY": str(PASS)}, lab=True
    ) as h:  # bob's Lab shows the notice
        yield h


@pytest.fixture(scope="module")
def users(hub):
    return {n: hub.login(n) for n in ("alice", "bob", "carol", "admin")}


HOLD_DOWN = re.compile(r"Reclaim: (\S+) withdrew \S+, for which .* before (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")


def hold_down_ends(hub) -> float:
    """When the last hold-down the hub logged ends (0: none). A lender who withdraws a request
    that reclaimed (carol stopping her server soon after a reclaim, as every test's cleanup
    does) reclaims nothing more for one notice after that reclaim (issue 19)."""
    ends = [
        datetime.strptime(m.group(2), "%Y-%m-%d %H:%M:%S").timestamp() + 1
        for m in HOLD_DOWN.finditer(hub.log.read_text(errors="replace"))
    ]
    return max(ends, default=0.0)


@pytest.fixture(autouse=True)
def clean(hub, users):
    yield
    running = [(u, name) for u in users.values() for name in list(u.model()["servers"])]
    for u, name in running:  # all stops sent at once, then waited for
        u.stop(name)
    for u, name in running:
        u.wait_gone(name)
    # The next test's lender starts unheld: wait out the hold-down the hub announced, if any.
    end = hold_down_ends(hub)
    wait_for(lambda: time.time() >= end, max(0.0, end - time.time()) + 5, "the lender's hold-down to end")


def warnings(client) -> dict:
    r = client.api.get(client.url(f"/gpuhub/culling/{client.name}"))
    r.raise_for_status()
    return r.json()


def holder_of_devices(users) -> dict[str, str]:
    snap = users["admin"].api.get(users["admin"].url("/gpuhub/status")).json()
    return {d["id"]: d.get("user") for d in snap["devices"] if d.get("held")}


def home_page(client) -> str:
    return client.session.get(client.hub.url + "/hub/home").text


def log_time(line: str) -> float:
    m = re.search(r"\[\w (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)", line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()


def borrow(users) -> None:
    """alice holds vision's own GPU, bob borrows NLP's (admitted later: reclaimed first). Both
    servers start together, bob's request sent once alice holds her GPU."""
    alice = users["alice"].start_background("gpu-1")
    wait_for(lambda: "alice" in holder_of_devices(users).values(), 60, "alice to be admitted")
    bob = users["bob"].start_background("gpu-1")
    for name, request in (("alice", alice), ("bob", bob)):
        assert request.result().status_code in (201, 202)
        users[name].wait_ready()


def test_idle_cohort_keeps_lending_and_a_withdrawn_request_withdraws_the_warning(hub, users):
    borrow(users)
    assert sorted(holder_of_devices(users).values()) == ["alice", "bob"]  # vision holds both GPUs
    assert warnings(users["bob"])["servers"] == {}
    carol = users["carol"]
    carol.start_background("gpu-1")
    wait_for(lambda: warnings(users["bob"])["servers"].get(""), 30, "bob's reclaim warning")
    carol.stop()  # she leaves the queue before the notice ends
    carol.wait_gone()
    wait_for(lambda: warnings(users["bob"])["servers"] == {}, 30, "the warning to be withdrawn")
    assert users["bob"].server()["ready"]  # NLP is idle again: vision keeps the loan
    assert "Reclaim: warning for bob/ withdrawn" in hub.log.read_text()


def test_a_lender_that_withdraws_reclaims_nothing_more_within_the_notice(hub, users):
    """Issue 19: carol (NLP) could start and cancel spawns at will, each request warning (or,
    for a job, preempting at once) a borrower of Vision's. After withdrawing a request that
    reclaimed, her next request within NLP's notice takes nothing back; it waits, and says
    until when. Then the GPU comes back as usual."""
    bob, carol = users["bob"], users["carol"]
    borrow(users)
    carol.start_background("gpu-1")
    first = wait_for(lambda: warnings(bob)["servers"].get(""), 30, "bob's reclaim warning")
    carol.stop()
    carol.wait_gone()
    wait_for(lambda: warnings(bob)["servers"] == {}, 30, "the warning to be withdrawn")

    carol.start_background("gpu-1")  # again, within the notice
    wait_for(lambda: carol.server() is not None, 30, "carol's request to be pending")
    events = carol.progress(
        until=lambda e: any(s in e.get("message", "") for s in ("nothing is taken back for you before", "being reclaimed")),
        timeout=30,
    )
    msg = events[-1]["message"]
    assert "nothing is taken back for you before" in msg and "bob" not in msg, msg
    assert warnings(bob)["servers"] == {}, "bob warned a second time within the notice"
    assert time.time() < first["deadline"], "too slow to tell: the hold-down has already ended"
    # One notice after the first reclaim the hold-down ends and NLP's GPU comes back as usual.
    second = wait_for(lambda: warnings(bob)["servers"].get(""), NOTICE + 30, "bob's warning after the hold-down")
    assert second["warned_at"] >= first["deadline"] - 0.5, (first, second)
    assert "Reclaim: carol withdrew carol/" in hub.log.read_text()
    carol.stop()
    carol.wait_gone()
    wait_for(lambda: warnings(bob)["servers"] == {}, 30, "the second warning to be withdrawn")
    assert bob.server()["ready"]


def test_borrowing_server_is_warned_then_stopped_after_the_notice_and_the_lender_admitted(hub, users):
    alice, bob, carol = users["alice"], users["bob"], users["carol"]
    borrow(users)
    carol.start_background("gpu-1")
    wait_for(lambda: carol.server() is not None, 30, "carol's request to be pending")
    # The lender's spawn page says what she waits for and until when.
    events = carol.progress(until=lambda e: "being reclaimed" in e.get("message", ""), timeout=30)
    msg = events[-1]["message"]
    assert "NLP Group's GPU is on loan to another team; it is being reclaimed and will be yours by" in msg, msg
    assert "at the latest" in msg and "bob" not in msg and "Waiting for 10s" not in events[0]["message"]
    # The borrower is warned: which GPU, that his team borrowed it, which team (not who) needs it back.
    w = warnings(bob)["servers"][""]
    assert w["rule"] == "reclaim" and w["snoozes_left"] == 0 and w["needed_by"] == "NLP Group"
    assert w["devices"] and w["reason"] == f"NLP Group needs back GPU {w['devices'][0]} that your team Vision Lab borrowed"
    assert warnings(alice)["servers"] == {}  # the earlier admission of the same team keeps hers
    page = home_page(bob)
    assert "gpuhub-cull-warning" in page and "cannot be snoozed" in page and "NLP Group" in page
    # ... and why this server was chosen (issue 20 item 6: alice, admitted earlier, keeps hers)
    assert "most recently started borrower" in page
    # No snooze for a reclaim.
    r = bob.api.post(bob.url("/gpuhub/culling/bob/snooze"), json={"server": ""})
    assert r.status_code == 409 and "cannot be snoozed" in r.json()["message"]
    # Stopped after the notice (files kept: the server is stopped, not deleted), carol admitted.
    bob.wait_gone(timeout=NOTICE + 30)
    ready = carol.wait_ready(timeout=60)
    assert ready["ready"]
    assert sorted(holder_of_devices(users).values()) == ["alice", "carol"]
    assert (hub.data / "home" / "bob").is_dir()
    page = home_page(bob)
    assert "to give back a borrowed GPU" in page
    form = bob.session.get(hub.url + "/hub/spawn").text  # why it stopped, where he would start it again
    assert 'id="gpuhub-stop-reason"' in form and "NLP Group needs back GPU" in form and "files are kept" in form
    # The timeline, from the hub's own log: warning -> stop no earlier than the deadline -> admission.
    lines = hub.log.read_text().splitlines()
    warned = [l for l in lines if "Reclaim: warning bob/" in l][-1]
    stopping = next(l for l in lines if "Reclaim: stopping bob/" in l and log_time(l) >= log_time(warned))
    admitted = next(l for l in lines if "Admitted carol/" in l and log_time(l) >= log_time(stopping))
    assert log_time(stopping) >= w["deadline"] - 0.5
    timeline = "\n".join((warned, stopping, admitted))
    (Path(os.environ.get("GPUHUB_EVIDENCE_DIR", hub.workdir)) / "reclaim-timeline.log").write_text(timeline + "\n")
    print(timeline)


@pytest.mark.skipif(os.geteuid() != 0, reason="jobs run as their user's account: needs a hub running as root")
def test_borrowing_job_is_preempted_at_once_and_requeued(hub, users, tmp_path):
    alice, bob, carol = users["alice"], users["bob"], users["carol"]
    assert alice.start("gpu-1").status_code in (201, 202)
    alice.wait_ready()
    spec = tmp_path / "job.yaml"
    spec.write_text(
        f"profile: gpu-1\ncommand: [{sys.executable}, -c, 'import time; time.sleep(600)']\n"
        "retries: {limit: 0, reasons: [preempted]}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "GPUHUB_TOKEN"))}
    env["GPUHUB_TOKEN"] = bob.token
    out = subprocess.run(
        [sys.executable, "-m", "gpuhub_spawner.cli", "job", "--hub", hub.url, "submit", str(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip().splitlines()[-1]

    def record():
        return bob.api.get(bob.url(f"/gpuhub/jobs/{job_id}")).json()

    wait_for(lambda: record()["state"] == "running", 60, "the job to run on the borrowed GPU")
    carol.start_background("gpu-1")
    carol.wait_ready(timeout=60)  # no notice for a job
    rec = wait_for(lambda: (r := record())["state"] == "queued" and r, 30, "the job back in the queue")
    first = rec["attempts"][0]
    assert first["reason"] == "preempted" and "NLP Group" in first["message"], first
    assert "the lab cohort has 0 free to lend" in rec["status"], rec["status"]
    assert warnings(bob)["servers"] == {}
    bob.api.delete(bob.url(f"/gpuhub/jobs/{job_id}"))


@pytest.mark.browser
def test_jupyterlab_and_the_spawn_page_in_chromium(hub, users):
    """bob's JupyterLab shows the reclaim warning (no Snooze) and drops it when the need goes;
    carol's spawn page says her team's GPU is being reclaimed and by when."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (run-tests.sh installs it as root)")
    bob, carol = users["bob"], users["carol"]
    borrow(users)
    lab = hub.server_url(bob.server()["url"]) + "lab"
    with chromium() as browser:
        try:

            def login(name):
                page = browser.new_context().new_page()
                page.set_default_timeout(90_000)
                log_in(page, hub.url, name)
                page.wait_for_load_state()
                return page

            page = login("bob")
            page.goto(lab)
            wait_lab_whole(page)
            cp = login("carol")
            cp.goto(hub.url + "/hub/spawn")
            cp.check("input[value=gpu-1]")
            cp.click("form button[type=submit], form input[type=submit]")
            message = cp.locator("#progress-message", has_text="being reclaimed")
            message.wait_for()
            text = message.inner_text()
            assert "NLP Group's GPU is on loan to another team; it is being reclaimed and will be yours by" in text, text
            assert "Waiting for 10s" not in text and "bob" not in text
            wait_for(lambda: warnings(bob)["servers"].get(""), 30, "bob's reclaim warning")
            page.evaluate("document.dispatchEvent(new Event('visibilitychange'))")  # poll now, not in 30 s
            toast = page.locator(".Toastify__toast", has_text="This server will be stopped")
            toast.wait_for()
            assert re.search(
                r"This server will be stopped at \d\d:\d\d \(in \d+ s\): NLP Group needs back GPU \d "
                r"that your team Vision Lab borrowed\. Your files are kept\.",
                toast.inner_text(),
            ), toast.inner_text()
            assert toast.get_by_role("button", name="Snooze").count() == 0
            if os.environ.get("GPUHUB_SCREENSHOT_DIR"):
                page.screenshot(path=os.path.join(os.environ["GPUHUB_SCREENSHOT_DIR"], "reclaim-warning.png"))
            carol.stop()  # she leaves the queue: the warning goes, in JupyterLab too
            carol.wait_gone()
            wait_for(lambda: warnings(bob)["servers"] == {}, 30, "the warning to be withdrawn")
            page.evaluate("document.dispatchEvent(new Event('visibilitychange'))")
            page.locator(".Toastify__toast", has_text="no longer scheduled to be stopped").wait_for()
        finally:
            browser.close()
    assert bob.server()["ready"]
