"""The hub's own rights, asked of the real API server's RBAC authorizer (issue 40).

``harness.install_hub_identity`` gives the hub the ServiceAccount and the bindings the install
guide gives it (``helm-values/user-namespace.yaml``, ``gpuhub render capacity-rbac``, ``gpuhub
render policy-rbac``) and a TokenRequest token. For every right of ``kube/rights.py`` (the list
``tests/unit/test_kube_rbac.py`` derives from the code's calls) ``kubectl auth can-i
--as=system:serviceaccount:gpuhub:hub`` must say yes, and for what the hub never does, no.
Then the check is shown to fail: with the Role as shipped before issue 40 the authorizer says
no to ``patch workloads`` and ``get pods/log``, and a Workload patch made with the hub's own
token is refused (403) and found in the audit log, which every real-plane end-to-end test
reads (``backends.RealBackend.check_hub_rights``).

Opt-in (``GPUHUB_CLUSTER=1``, ``tests/cluster/up.sh``); skipped with the reason otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import requests
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))

import harness as real  # noqa: E402

from gpuhub_spawner.kube import rights  # noqa: E402

SKIP = real.skip_reason()
pytestmark = [pytest.mark.cluster, pytest.mark.skipif(bool(SKIP), reason=SKIP or "")]

USERS_NS = "gpuhub-users"
REPO = Path(__file__).resolve().parents[2]
POLICY = """\
flavors:
  - {name: l4, displayName: L4, resource: nvidia.com/gpu, nodeLabels: {nvidia.com/gpu.product: NVIDIA-L4}}
teams:
  - {name: shared, groups: [s], quota: {gpus: {l4: 2}}}
profiles:
  - {slug: l4-1, displayName: One L4, gpu: {count: 1, flavor: l4}, teams: "*"}
health:
  kubernetes:
    capacityQueue: {l4: shared}
"""
# What the hub never does: each must be refused.
NEVER = [
    (USERS_NS, ["get", "pods"]),
    (USERS_NS, ["update", "workloads.kueue.x-k8s.io"]),
    (USERS_NS, ["delete", "workloads.kueue.x-k8s.io"]),
    (USERS_NS, ["create", "pods", "--subresource=exec"]),
    (USERS_NS, ["get", "secrets"]),
    (USERS_NS, ["delete", "services"]),  # a job's rendezvous Service is only created; the garbage collector deletes it
    (USERS_NS, ["create", "rolebindings.rbac.authorization.k8s.io"]),
    ("default", ["create", "pods"]),
    ("default", ["patch", "workloads.kueue.x-k8s.io"]),
    (real.HUB_NAMESPACE, ["get", "configmaps/kube-root-ca.crt"]),
    (real.HUB_NAMESPACE, ["get", "secrets"]),
    (None, ["watch", "nodes"]),
    (None, ["patch", "nodes"]),
    (None, ["patch", "clusterqueues.kueue.x-k8s.io/other"]),
    (None, ["create", "namespaces"]),
]


@pytest.fixture(scope="module")
def identity(real_cluster, tmp_path_factory):
    work = tmp_path_factory.mktemp("hub-rights")
    (work / "profiles.yaml").write_text(POLICY)
    real_cluster.ensure_namespace(USERS_NS)
    kubeconfig = real.install_hub_identity(real_cluster, work / "profiles.yaml", work)
    yield real_cluster, kubeconfig
    real_cluster.kubectl("apply", "-f", str(REPO / "helm-values" / "user-namespace.yaml"))  # as shipped again


def can_i(cluster, ns, args) -> str:
    where = ["-n", ns] if ns else []
    p = cluster.kubectl("auth", "can-i", *args, *where, f"--as={real.HUB_USER}", check=False)
    return p.stdout.strip() or p.stderr.strip()


def question(right: rights.Right, verb: str) -> tuple[str | None, list[str]]:
    args = rights.can_i_args(right.group, right.resource, verb)
    if right.by_name:
        name = "gpuhub-policy" if right.scope == rights.HUB else "shared"
        args[1] += f"/{name}"
    ns = {rights.USERS: USERS_NS, rights.HUB: real.HUB_NAMESPACE, rights.CLUSTER: None}[right.scope]
    return ns, args


def test_the_authorizer_grants_every_right_the_code_uses_and_nothing_named_outside_it(identity):
    cluster, _ = identity
    answers = {}
    for right in rights.RIGHTS:
        for verb in right.verbs:
            ns, args = question(right, verb)
            answers[(ns, " ".join(args))] = can_i(cluster, ns, args)
    print(
        "\n[real] kubectl auth can-i --as="
        + real.HUB_USER
        + ":\n"
        + "\n".join(f"  {a} {'-n ' + ns if ns else '(cluster)'}: {v}" for (ns, a), v in answers.items())
    )
    assert {k: v for k, v in answers.items() if v != "yes"} == {}
    # issue 40's two, asked as the guide's section 5 asks them
    assert answers[(USERS_NS, "patch workloads.kueue.x-k8s.io")] == "yes"
    assert answers[(USERS_NS, "get pods --subresource=log")] == "yes"
    refused = {(ns, " ".join(a)): can_i(cluster, ns, a) for ns, a in NEVER}
    print(
        "[real] and refused:\n" + "\n".join(f"  {a} {'-n ' + ns if ns else '(cluster)'}: {v}" for (ns, a), v in refused.items())
    )
    assert {k: v for k, v in refused.items() if v != "no"} == {}


def test_the_role_before_issue_40_fails_the_same_check_and_the_audit_log_shows_the_refusal(identity):
    cluster, kubeconfig = identity
    docs = [d for d in yaml.safe_load_all((REPO / "helm-values" / "user-namespace.yaml").read_text()) if d]
    role = next(d for d in docs if d["kind"] == "Role")
    old = dict(
        role,
        rules=[
            dict(r, verbs=[v for v in r["verbs"] if v != "patch"]) if "workloads" in r["resources"] else r
            for r in role["rules"]
            if r["resources"] != ["pods/log"]
        ],
    )
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(old))
    assert can_i(cluster, USERS_NS, ["patch", "workloads.kueue.x-k8s.io"]) == "no"
    assert can_i(cluster, USERS_NS, ["get", "pods", "--subresource=log"]) == "no"
    # The hub's own token: the ledger's merge patch of spec.active is refused before Kueue sees it.
    mark = real.audit_mark()
    token = yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["token"]
    r = requests.patch(
        cluster.url + f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{USERS_NS}/workloads/no-such-workload",
        data='{"spec": {"active": false}}',
        verify=cluster.session.verify,
        timeout=15,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/merge-patch+json"},
    )
    assert r.status_code == 403, (r.status_code, r.text)
    seen = real.hub_requests(mark)
    assert [(c["verb"], c["resource"], c["code"]) for c in seen] == [("patch", "workloads", 403)], seen
    cluster.kubectl("apply", "-f", str(REPO / "helm-values" / "user-namespace.yaml"))
    assert can_i(cluster, USERS_NS, ["patch", "workloads.kueue.x-k8s.io"]) == "yes"
    r = requests.patch(
        cluster.url + f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{USERS_NS}/workloads/no-such-workload",
        data='{"spec": {"active": false}}',
        verify=cluster.session.verify,
        timeout=15,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/merge-patch+json"},
    )
    assert r.status_code == 404, (r.status_code, r.text)  # allowed now; there is no such Workload
