"""Tenancy an operator chooses in the policy (``tenancy:``): one shared users' namespace, or one
namespace per team (``kube/tenancy.py``, ``gpuhub render tenancy``).

* The shared mode renders exactly ``helm-values/user-namespace.yaml``, the file the guide applies.
* The team mode: each team's namespace with Pod Security ``restricted``, the hub's Role (every
  right ``kube/rights.py`` lists for a users' namespace, derived from the code's calls, and
  nothing else) and RoleBinding, and the NetworkPolicies; the Kueue render puts each team's
  LocalQueue in its namespace and lets its ClusterQueue admit only that namespace's pods. All
  of it passes kubernetes-validate and the real Kueue CRDs (the API double validates).
* The attack, from team A's seat: evaluated over the real pod manifests (KueueSpawner's,
  a job's), no pod of team A reaches team B's server or job, and the hub keeps its way in.
* Through the API double: servers of two teams start in their teams' namespaces, each gated
  and admitted by its team's queue, and the hub's ledger mirrors both namespaces.
* On the real control plane (``GPUHUB_CLUSTER=1``): the render applied as an operator would,
  ``kubectl auth can-i --as=system:serviceaccount:gpuhub:hub`` says yes to every right in each
  team namespace and no to all of them in namespaces the render does not list; the hub's own
  token creates a server pod in its team's namespace (admitted under ``restricted``, gated by
  Kueue into the team's queue) and is refused (403) one namespace over; the NetworkPolicy
  selectors, asked of the API server, let no pod of team A in to team B's server. kwok runs no
  network and there is no CNI here: nothing *enforces* the policies, they are shown to select
  exactly the right pods.
"""

from __future__ import annotations

import asyncio
import ipaddress
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import yaml
from kubernetes_asyncio.client import ApiClient

from double.harness import NAMESPACE, REPO
from double.schemas import validate_core
from gpuhub_spawner.jobs.spec import JobSpec
from gpuhub_spawner.kube import rights
from gpuhub_spawner.kube.job_manifest import JOB_LABEL, job_manifest
from gpuhub_spawner.kube.render import render_objects
from gpuhub_spawner.kube.tenancy import tenancy_objects
from gpuhub_spawner.kube.walls import label_selector, selects, wall
from gpuhub_spawner.policy.access import resolve_choice
from gpuhub_spawner.policy.loader import PolicyError, parse_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import harness as real  # noqa: E402

HUB_NS = "gpuhub"
SA = "gpuhub:hub"
TEAMS = {"vision": "gpuhub-t-vision", "nlp": "gpuhub-t-nlp", "students": "gpuhub-t-students"}
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
WAIT = 60


def team_mode(policy_file: Path) -> None:
    """The shipped policy with one namespace per team (Ray off: it needs the shared mode)."""
    text = policy_file.read_text().replace("ray:\n  enabled: true", "ray:\n  enabled: false")
    assert "enabled: false" in text
    policy_file.write_text(text + "\ntenancy:\n  mode: team\n  namespace: gpuhub-t-{team}\n")


def _docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


# -- the render ---------------------------------------------------------------------------------
def test_the_shared_mode_renders_exactly_the_shipped_user_namespace(policy_store):
    shipped = _docs((REPO / "helm-values" / "user-namespace.yaml").read_text())
    assert tenancy_objects(policy_store.policy, NAMESPACE, SA) == shipped
    # and the Kueue objects stay where they were
    queues = [o for o in render_objects(policy_store.policy, NAMESPACE) if o["kind"] == "LocalQueue"]
    assert {q["metadata"]["namespace"] for q in queues} == {NAMESPACE}


async def test_the_team_mode_renders_each_teams_namespace_rights_and_walls(policy_file, policy_store, kube):
    team_mode(policy_file)
    policy = parse_policy(policy_file.read_text(), str(policy_file))
    objs = tenancy_objects(policy, NAMESPACE, SA)
    for o in objs:
        validate_core(o)  # kubernetes-validate 1.30, strict
    by = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objs}
    namespaces = [o for o in objs if o["kind"] == "Namespace"]
    assert {n["metadata"]["name"]: n["metadata"]["labels"]["gpuhub.io/team"] for n in namespaces} == {
        v: k for k, v in TEAMS.items()
    }
    for n in namespaces:
        labels = n["metadata"]["labels"]
        assert {labels[f"pod-security.kubernetes.io/{m}"] for m in ("enforce", "warn", "audit")} == {"restricted"}
    for ns in TEAMS.values():
        for kind, name in [("Role", "gpuhub-hub"), ("RoleBinding", "gpuhub-hub"), ("NetworkPolicy", "gpuhub-singleuser")]:
            assert (kind, ns, name) in by
    # No cluster-wide grant here, and the hub's Role in each namespace is exactly the rights the
    # code's calls need in a users' namespace (tests/unit/test_kube_rbac.py derives them).
    assert not [o for o in objs if o["kind"].startswith("Cluster")]
    needed = {(g, r, v) for s, g, r, v in rights.needed() if s == rights.USERS}
    for role in (o for o in objs if o["kind"] == "Role"):
        granted = {
            (g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
        }
        assert granted == needed
        assert all(rights.grants(role["rules"], g, r, v) for g, r, v in needed)
    bound = {o["metadata"]["namespace"] for o in objs if o["kind"] == "RoleBinding"}
    assert bound == set(TEAMS.values())
    assert all(
        o["subjects"] == [{"kind": "ServiceAccount", "name": "hub", "namespace": HUB_NS}]
        for o in objs
        if o["kind"] == "RoleBinding"
    )
    # Kueue: each LocalQueue in its team's namespace, each ClusterQueue admitting only it
    # (the double validates them against Kueue v0.19.2's CRDs).
    kueue = render_objects(policy, NAMESPACE)
    kube.apply(kueue)
    assert kube.invalid == []
    for q in (o for o in kueue if o["kind"] == "LocalQueue"):
        assert q["metadata"]["namespace"] == TEAMS[q["spec"]["clusterQueue"]]
    for cq in (o for o in kueue if o["kind"] == "ClusterQueue"):
        assert cq["spec"]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": TEAMS[cq["metadata"]["name"]]}}


def test_a_bad_tenancy_is_refused_with_its_place(policy_file):
    base = policy_file.read_text()
    for tail, where, words in [
        ("tenancy: {mode: team, namespace: gpuhub}", "tenancy.namespace", "{team} once"),
        ("tenancy: {mode: team, namespace: 'Gpuhub-{team}'}", "tenancy.namespace", "lowercase"),
        ("tenancy: {mode: teams}", "tenancy.mode", "shared"),
        ("tenancy: {mode: team}", "ray.enabled", "tenancy.mode shared"),
    ]:
        with pytest.raises(PolicyError) as e:
            parse_policy(base + "\n" + tail + "\n", "profiles.yaml")
        text = str(e.value)
        assert where in text and words in text, text
    # the hub's own namespace is never a team's
    policy = parse_policy(
        base.replace("ray:\n  enabled: true", "ray:\n  enabled: false") + "\ntenancy: {mode: team, namespace: '{team}'}\n",
        "profiles.yaml",
    )
    tenancy_objects(policy, NAMESPACE, SA)
    with pytest.raises(ValueError, match="'vision' is the hub's"):
        tenancy_objects(policy, NAMESPACE, "vision:hub")


# -- the attack from team A's seat -----------------------------------------------------------------
async def _team_pods(make_spawner, policy) -> dict[str, tuple[str, dict]]:
    """name -> (namespace, labels): a server and a job pod of a vision user and of a student,
    from the real manifests, in the namespace the spawner chose; the chart's hub and proxy."""
    out: dict[str, tuple[str, dict]] = {}
    for user, group, team, profile in [("vic", "vision-lab", "vision", "a100-1"), ("stu", "students", "students", "l4-1")]:
        spawner = make_spawner(user=user, groups=(group,), profile=profile)
        await spawner.load_user_options()
        pod = ApiClient().sanitize_for_serialization(await spawner.get_pod_manifest())
        assert spawner.namespace == TEAMS[team], (user, spawner.namespace)
        out[f"{team}-server"] = (spawner.namespace, pod["metadata"]["labels"])
        choice = resolve_choice(policy, [group], {"profile": profile})
        job = job_manifest(
            f"job-{user}",
            user,
            JobSpec.model_validate({"profile": profile, "command": ["sleep", "1"]}),
            policy,
            choice,
            pod,
            namespace=spawner.namespace,
        )
        out[f"{team}-job"] = (spawner.namespace, job["spec"]["template"]["metadata"]["labels"])
    out["hub"] = (HUB_NS, {"component": "hub", "app": "jupyterhub"})
    out["proxy"] = (HUB_NS, {"component": "proxy", "app": "jupyterhub"})
    return out


def _peer_allows(peer: dict, policy_ns: str, src_ns: str, src_labels: dict, ns_labels) -> bool:
    if "ipBlock" in peer:  # pod addresses are private (10.x here): the except list keeps them out
        block = peer["ipBlock"]
        pod_ip = ipaddress.ip_address("10.244.1.7")
        return pod_ip in ipaddress.ip_network(block["cidr"]) and not any(
            pod_ip in ipaddress.ip_network(e) for e in block.get("except", [])
        )
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], ns_labels(src_ns)):
            return False
    elif src_ns != policy_ns:
        return False
    return selects(peer.get("podSelector") or {}, src_labels)


def reaches(policies: list[dict], pods, src: str, dst: str, ns_labels, port: int) -> bool:
    """NetworkPolicy semantics for a TCP connection to ``port``: allowed if the source's egress
    (when some policy selects it for Egress) lets it out to the destination AND the
    destination's ingress (likewise) lets it in. A rule with ``ports`` applies to those only;
    a rule without ``to``/``from`` to every peer."""
    (sns, slabels), (dns, dlabels) = pods[src], pods[dst]

    def side(ns, labels, kind, rules_key, peers_key, other_ns, other_labels) -> bool:
        selecting = [
            p
            for p in policies
            if p["metadata"]["namespace"] == ns and kind in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], labels)
        ]
        if not selecting:
            return True  # not isolated on this side
        for p in selecting:
            for rule in p["spec"].get(rules_key) or []:
                if "ports" in rule and not any(
                    q.get("port") == port and q.get("protocol", "TCP") == "TCP" for q in rule["ports"]
                ):
                    continue
                if peers_key not in rule or any(
                    _peer_allows(peer, ns, other_ns, other_labels, ns_labels) for peer in rule[peers_key]
                ):
                    return True
        return False

    return side(sns, slabels, "Egress", "egress", "to", dns, dlabels) and side(
        dns, dlabels, "Ingress", "ingress", "from", sns, slabels
    )


def _ns_labels(ns: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": ns}


async def test_no_pod_of_one_team_reaches_another_teams_server_or_job(make_spawner, policy_file, policy_store):
    team_mode(policy_file)
    policy = await policy_store.fresh()  # (a slow first load re-reads beside the loop)
    assert policy.tenancy.mode == "team"
    pods = await _team_pods(make_spawner, policy)
    namespace_policies = [o for o in tenancy_objects(policy, NAMESPACE, SA) if o["kind"] == "NetworkPolicy"]
    # each job's own wall, as the hub makes it with the Job (kube/walls.py)
    walls = [
        p
        for team in ("vision", "students")
        for p in wall(
            f"job-{team}",
            TEAMS[team],
            {JOB_LABEL: f"job-{'vic' if team == 'vision' else 'stu'}"},
            pods[f"{team}-server"][1],
            HUB_NS,
        )
    ]
    ports = (8888, 6379, 12345)  # a server's, Ray's GCS, anything a job opens
    for policies, what in ((namespace_policies + walls, "as deployed"), (namespace_policies, "without the jobs' walls")):
        for a, b in [("vision", "students"), ("students", "vision")]:
            for src in (f"{a}-server", f"{a}-job"):
                for dst in (f"{b}-server", f"{b}-job"):
                    reached = [port for port in ports if reaches(policies, pods, src, dst, _ns_labels, port)]
                    assert reached == [], f"{src} reaches {dst} on {reached} ({what})"
    for victim in ("students-server", "vision-server"):  # the way in the hub needs stays
        assert reaches(namespace_policies + walls, pods, "proxy", victim, _ns_labels, 8888)
        assert reaches(namespace_policies + walls, pods, "hub", victim, _ns_labels, 8888)
    assert reaches(
        namespace_policies + walls, pods, "vision-server", "vision-job", _ns_labels, 12345
    )  # the owner reaches their job
    # The same pods in one shared namespace: there only the job's wall keeps another team's
    # job out (gpuhub-batch lets a job's pods out to every pod of the namespace).
    shared = {k: (NAMESPACE if ns != HUB_NS else ns, labels) for k, (ns, labels) in pods.items()}
    shared_policy = policy.model_copy(update={"tenancy": policy.tenancy.model_copy(update={"mode": "shared"})})
    shared_policies = [o for o in tenancy_objects(shared_policy, NAMESPACE, SA) if o["kind"] == "NetworkPolicy"]
    assert reaches(shared_policies, shared, "vision-job", "students-job", _ns_labels, 12345)


# -- through the API double: servers of two teams ------------------------------------------------
async def test_two_teams_servers_start_in_their_own_namespaces_and_the_ledger_mirrors_both(
    make_spawner, policy_file, policy_store, kube, tmp_path
):
    from traitlets.config import Config

    from gpuhub_spawner.culling.board import CullBoard
    from gpuhub_spawner.kube.ledger import KueueLedger
    from gpuhub_spawner.usage.recorder import UsageRecorder

    team_mode(policy_file)
    policy = await policy_store.fresh()
    assert policy.tenancy.mode == "team"
    kube.reset()
    kube.apply(render_objects(policy, NAMESPACE))
    kube.webhook_namespaces = set(TEAMS.values())  # Kueue manages each team's namespace
    for cls in (KueueLedger, UsageRecorder, CullBoard):
        cls.clear_instance()
    c = Config()
    c.CullBoard.state_file = str(tmp_path / "culling.json")
    c.KueueLedger.sync_interval = 0.2
    ledger = KueueLedger.instance(config=c)
    try:
        vic = make_spawner(user="vic", groups=("vision-lab",), profile="a100-1", cmd=SLEEPER)
        stu = make_spawner(user="stu", groups=("students",), profile="l4-1", cmd=SLEEPER)
        await asyncio.wait_for(asyncio.gather(vic.start(), stu.start()), WAIT)
        assert (vic.namespace, stu.namespace) == (TEAMS["vision"], TEAMS["students"])
        for s, team in ((vic, "vision"), (stu, "students")):
            pod = kube.get("pods", TEAMS[team], s.pod_name)
            assert pod is not None and pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == team
            assert kube.get("pods", NAMESPACE, s.pod_name) is None
            wls = kube.list("workloads", TEAMS[team])
            assert [w["status"]["admission"]["clusterQueue"] for w in wls] == [team]
        # the hub's mirror: a watcher spawner of the shared namespace, as the hub config makes it
        watcher = make_spawner(user="gpuhub-ledger", groups=("vision-lab",), profile="")
        await asyncio.wait_for(ledger.watch(watcher), WAIT)
        assert set(ledger._sources) == set(TEAMS.values())

        async def both():
            while set(ledger.queue.admitted) != {"vic/", "stu/"}:
                await asyncio.sleep(0.05)

        try:
            await asyncio.wait_for(both(), WAIT)
        except TimeoutError:
            raise AssertionError(
                f"the ledger never showed both teams' servers admitted: {sorted(ledger.queue.admitted)}"
            ) from None
        assert {a.team for a in ledger.queue.admitted.values()} == {"vision", "students"}
        await asyncio.wait_for(asyncio.gather(vic.stop(), stu.stop()), WAIT)
        assert kube.invalid == [] and kube.errors == []
    finally:
        if ledger._sync is not None:
            ledger._sync.stop()
        for cls in (KueueLedger, UsageRecorder, CullBoard):
            cls.clear_instance()
        kube.webhook_namespaces = {NAMESPACE}


# -- the real control plane ----------------------------------------------------------------------
SKIP = real.skip_reason()
OUTSIDER = "gpuhub-t-outsider"  # a namespace the render does not list


def _can_i(cluster, ns, args) -> str:
    p = cluster.kubectl("auth", "can-i", *args, "-n", ns, f"--as={real.HUB_USER}", check=False)
    return p.stdout.strip() or p.stderr.strip()


@pytest.mark.cluster
@pytest.mark.skipif(bool(SKIP), reason=SKIP or "")
async def test_on_the_real_plane_the_hub_has_its_rights_in_each_team_namespace_and_none_outside(
    make_spawner, policy_file, policy_store, real_cluster, tmp_path
):
    cluster = real_cluster
    team_mode(policy_file)
    policy = await policy_store.fresh()
    assert policy.tenancy.mode == "team"
    rendered = {}
    for what in ("tenancy", "kueue"):
        p = subprocess.run(
            [str(real.VENV_BIN / "gpuhub"), "render", what, str(policy_file), "--namespace", NAMESPACE],
            capture_output=True,
            text=True,
        )
        assert p.returncode == 0, p.stderr
        rendered[what] = p.stdout
    try:
        cluster.kubectl("apply", "-f", "-", input=rendered["tenancy"])  # as the guide's section 2
        cluster.kubectl("apply", "-f", "-", input=rendered["kueue"])
        cluster.ensure_namespace(OUTSIDER)
        kubeconfig = real.install_hub_identity(cluster, policy_file, tmp_path / "identity")
        answers = {}
        for right in (r for r in rights.RIGHTS if r.scope == rights.USERS):
            for verb in right.verbs:
                args = rights.can_i_args(right.group, right.resource, verb)
                for ns in [*TEAMS.values(), OUTSIDER, "default"]:
                    answers[(ns, " ".join(args))] = _can_i(cluster, ns, args)
        print(
            "\n[real] kubectl auth can-i --as="
            + real.HUB_USER
            + ":\n"
            + "\n".join(f"  {a} -n {ns}: {v}" for (ns, a), v in sorted(answers.items()))
        )
        assert {k: v for k, v in answers.items() if k[0] in TEAMS.values() and v != "yes"} == {}
        assert {k: v for k, v in answers.items() if k[0] not in TEAMS.values() and v != "no"} == {}
        # The hub's own token: a server pod of a vision user, made by KueueSpawner, in vision's
        # namespace (Pod Security restricted admits it, Kueue gates it into vision's queue) ...
        vic = make_spawner(user="vic", groups=("vision-lab",), profile="a100-1")
        await vic.load_user_options()
        pod = ApiClient().sanitize_for_serialization(await vic.get_pod_manifest())
        pod["metadata"].pop("namespace", None)
        token = yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["token"]
        headers = {"Authorization": f"Bearer {token}"}
        r = requests.post(
            cluster.url + f"/api/v1/namespaces/{TEAMS['vision']}/pods",
            json=pod,
            headers=headers,
            verify=cluster.session.verify,
            timeout=15,
        )
        assert r.status_code == 201, r.text
        made = r.json()
        assert {"name": "kueue.x-k8s.io/admission"} in (made["spec"].get("schedulingGates") or []), made["spec"]
        # ... its Workload lands in vision's ClusterQueue (the team's quota), and the same pod
        # one namespace over is refused by RBAC before anything else sees it.
        cluster.kubectl(
            "-n",
            TEAMS["vision"],
            "wait",
            "workloads",
            "--all",
            "--for=jsonpath={.status.admission.clusterQueue}=vision",
            "--timeout=60s",
        )
        r = requests.post(
            cluster.url + f"/api/v1/namespaces/{OUTSIDER}/pods",
            json=pod,
            headers=headers,
            verify=cluster.session.verify,
            timeout=15,
        )
        assert r.status_code == 403, r.text
        # NetworkPolicy selectors asked of the API server: into students' servers, only the
        # hub's and the proxy's pods; vision's pods are not among them.
        stand_ins = await _team_pods(make_spawner, policy)
        for ns in (HUB_NS,):
            cluster.ensure_namespace(ns)
        for name, (ns, labels) in stand_ins.items():
            labels = {k: v for k, v in labels.items() if not k.startswith("kueue.x-k8s.io/")}
            cluster.create(
                "pods",
                ns,
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": f"tenancy-{name}", "labels": labels},
                    "spec": real.restricted(
                        {
                            "containers": [{"name": "c", "image": "registry.example.com/stand-in:1"}],
                            "nodeSelector": {"gpuhub.io/no-such-node": "true"},
                        }
                    ),
                },
            )
        su = cluster.get(f"/apis/networking.k8s.io/v1/namespaces/{TEAMS['students']}/networkpolicies/gpuhub-singleuser")
        allowed = set()
        for rule in su["spec"]["ingress"]:
            for peer in rule["from"]:
                nss = (
                    [
                        n["metadata"]["name"]
                        for n in cluster.list("namespaces", labelSelector=label_selector(peer["namespaceSelector"]))
                    ]
                    if "namespaceSelector" in peer
                    else [TEAMS["students"]]
                )
                for ns in nss:
                    for p in cluster.list("pods", ns, labelSelector=label_selector(peer.get("podSelector") or {})):
                        if p["metadata"]["name"].startswith("tenancy-"):
                            allowed.add(p["metadata"]["name"][len("tenancy-") :])
        print(f"[real] into students' servers ({TEAMS['students']}/gpuhub-singleuser): {sorted(allowed)}")
        assert allowed == {"hub", "proxy"}
    finally:
        for ns in [*TEAMS.values(), OUTSIDER]:
            cluster.kubectl("delete", "namespace", ns, "--ignore-not-found", "--wait=false", check=False)
        for name in ("hub", "proxy"):
            cluster.kubectl(
                "-n", HUB_NS, "delete", "pod", f"tenancy-{name}", "--ignore-not-found", "--grace-period=0", check=False
            )
        # the shared mode's Kueue objects again (the team mode's ClusterQueues name other namespaces)
        cluster.kubectl(
            "apply",
            "-f",
            "-",
            input=yaml.safe_dump_all(
                render_objects(
                    parse_policy((REPO / "jupyterhub_config" / "profiles.yaml").read_text(), "profiles.yaml"), NAMESPACE
                )
            ),
        )
