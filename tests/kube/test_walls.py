"""The wall around a user's Ray cluster and job on Kubernetes (issue 39, ``kube/walls.py``).

The labels come from the real manifests: alice's and bob's server pods as KueueSpawner makes
them (the real KubeSpawner code path), their Ray clusters' head and worker templates
(``ray_cluster_manifest``) and their jobs' pod templates (``job_manifest``), plus the hub and
proxy pods of the chart (``component: hub`` / ``proxy`` in ``gpuhub``).

* Everywhere: the policies pass kubernetes-validate (Kubernetes 1.30, strict), and evaluated
  over those pods the selectors let into alice's Ray pods and job pods exactly her own pods and
  the hub, and let only her pods out to them.
* On the real control plane (``GPUHUB_CLUSTER=1``): the same pods and policies are created
  (the API server validates them), then every selector of every policy is asked of the API
  server (``labelSelector`` on pods, and on namespaces for ``namespaceSelector``) and the pods
  it returns are compared with the expected set; the policies, owned by a real Job, are deleted
  by the real garbage collector with it. kwok runs no network and there is no CNI here, so
  nothing *enforces* these policies: what is shown is that they select exactly the right pods.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
from kubernetes_asyncio.client import ApiClient

from double.schemas import validate_core
from gpuhub_spawner.jobs.spec import JobSpec
from gpuhub_spawner.kube.job_manifest import JOB_LABEL, job_manifest
from gpuhub_spawner.kube.ray_manifest import RAY_LABEL, WorkerGroup, ray_cluster_manifest
from gpuhub_spawner.kube.walls import label_selector, selects, wall
from gpuhub_spawner.policy.access import resolve_choice

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import harness as real  # noqa: E402

NS, HUB_NS, OTHER_NS = "gpuhub-users", "gpuhub", "gpuhub-walls-other"


async def _pods(make_spawner, policy_store) -> dict[str, tuple[str, dict]]:
    """name -> (namespace, labels) of every pod that could knock, from the real manifests."""
    policy = policy_store.policy
    policy = policy.model_copy(update={"ray": policy.ray.model_copy(update={"enabled": True})})
    out: dict[str, tuple[str, dict]] = {}
    for user in ("alice", "bob"):
        spawner = make_spawner(user=user, groups=("vision-lab",), profile="a100-1")
        await spawner.load_user_options()
        pod = ApiClient().sanitize_for_serialization(await spawner.get_pod_manifest())
        out[f"{user}-server"] = (NS, pod["metadata"]["labels"])
        choice = resolve_choice(policy, ["vision-lab"], {"profile": "a100-1"})
        rc = ray_cluster_manifest(f"ray-{user}", user, policy, choice, pod, [WorkerGroup("gpu", 1, 1)], namespace=NS)
        out[f"{user}-ray-head"] = (NS, rc["spec"]["headGroupSpec"]["template"]["metadata"]["labels"])
        out[f"{user}-ray-worker"] = (NS, rc["spec"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"])
        job = job_manifest(
            f"job-{user}",
            user,
            JobSpec.model_validate({"profile": "a100-1", "command": ["sleep", "1"]}),
            policy,
            choice,
            pod,
            namespace=NS,
        )
        out[f"{user}-job"] = (NS, job["spec"]["template"]["metadata"]["labels"])
    out["hub"] = (HUB_NS, {"component": "hub", "app": "jupyterhub"})
    out["proxy"] = (HUB_NS, {"component": "proxy", "app": "jupyterhub"})
    out["hub-elsewhere"] = (OTHER_NS, {"component": "hub", "app": "jupyterhub"})  # a "hub" of another namespace
    return out


def _walls(pods) -> dict[str, list[dict]]:
    server = pods["alice-server"][1]
    return {
        "ray": wall("ray-alice", NS, {RAY_LABEL: "ray-alice"}, server, HUB_NS),
        "job": wall("job-alice", NS, {JOB_LABEL: "job-alice"}, server, HUB_NS),
    }


ALICE = {"alice-server", "alice-job", "alice-ray-head", "alice-ray-worker"}
EXPECTED_IN = {  # who may reach the object's pods, by any rule of its "-in" policy
    "ray": {"alice-server", "alice-job", "alice-ray-head", "alice-ray-worker", "hub"},
    "job": {"alice-server", "alice-job", "hub"},
}
EXPECTED_TARGETS = {"ray": {"alice-ray-head", "alice-ray-worker"}, "job": {"alice-job"}}
EXPECTED_OUT_FROM = {"alice-server", "alice-job"}  # the owner's server and job pods


def _peer_matches(peer: dict, pods, policy_ns: str, ns_labels) -> set[str]:
    found = set()
    for name, (ns, labels) in pods.items():
        if "namespaceSelector" in peer:
            if not selects(peer["namespaceSelector"], ns_labels(ns)):
                continue
        elif ns != policy_ns:
            continue
        if selects(peer.get("podSelector") or {}, labels):
            found.add(name)
    return found


def _ns_labels(ns: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": ns}  # what the API server puts on every namespace


async def test_the_walls_validate_and_select_exactly_the_owners_pods_and_the_hub(make_spawner, policy_store):
    pods = await _pods(make_spawner, policy_store)
    for kind, (inbound, outbound) in _walls(pods).items():
        for p in (inbound, outbound):
            validate_core(p)  # kubernetes-validate 1.30, strict
        targets = {n for n, (ns, labels) in pods.items() if ns == NS and selects(inbound["spec"]["podSelector"], labels)}
        assert targets == EXPECTED_TARGETS[kind]
        allowed = set().union(
            *(_peer_matches(peer, pods, NS, _ns_labels) for rule in inbound["spec"]["ingress"] for peer in rule["from"])
        )
        assert allowed == EXPECTED_IN[kind], (kind, sorted(allowed))
        assert not allowed & {"bob-server", "bob-job", "bob-ray-head", "bob-ray-worker", "proxy", "hub-elsewhere"}
        senders = {n for n, (ns, labels) in pods.items() if ns == NS and selects(outbound["spec"]["podSelector"], labels)}
        assert senders == EXPECTED_OUT_FROM
        assert outbound["spec"]["egress"] == [{"to": [{"podSelector": inbound["spec"]["podSelector"]}]}]
        assert inbound["spec"]["policyTypes"] == ["Ingress"] and outbound["spec"]["policyTypes"] == ["Egress"]


def _ray_egress_policy() -> dict:
    import yaml

    docs = yaml.safe_load_all((Path(__file__).resolve().parents[2] / "helm-values" / "user-namespace.yaml").read_text())
    return next(d for d in docs if d and d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "gpuhub-batch")


BATCH_PODS = {"alice-ray-head", "alice-ray-worker", "bob-ray-head", "bob-ray-worker", "alice-job", "bob-job"}


async def test_job_and_ray_pods_get_the_servers_way_out_without_the_metadata_address(make_spawner, policy_store):
    """z2jh's iptables init container (which job and Ray pods inherited) is off: gpuhub-batch
    gives them the server pods' egress, the cloud metadata address excluded; and they are no
    notebook servers (gpuhub-singleuser, the proxy's way in, KubeSpawner's reflector)."""
    pods = await _pods(make_spawner, policy_store)
    policy = _ray_egress_policy()
    validate_core(policy)
    selected = {n for n, (ns, labels) in pods.items() if ns == NS and selects(policy["spec"]["podSelector"], labels)}
    assert selected == BATCH_PODS
    assert {labels["component"] for n, (ns, labels) in pods.items() if n in BATCH_PODS} == {
        "gpuhub-job",
        "gpuhub-ray-head",
        "gpuhub-ray-worker",
    }
    assert policy["spec"]["policyTypes"] == ["Egress"]
    blocks = [p["ipBlock"] for rule in policy["spec"]["egress"] for p in rule.get("to") or [] if "ipBlock" in p]
    assert blocks == [{"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.169.254/32"]}]


def test_label_selector_strings():
    assert label_selector({"matchLabels": {"b": "2", "a": "1"}}) == "a=1,b=2"
    assert label_selector({"matchExpressions": [{"key": "c", "operator": "In", "values": ["x", "y"]}]}) == "c in (x,y)"


# -- the real control plane ----------------------------------------------------------------------
SKIP = real.skip_reason()


@pytest.mark.cluster
@pytest.mark.skipif(bool(SKIP), reason=SKIP or "")
async def test_on_the_real_api_server_each_selector_selects_exactly_the_owners_pods(make_spawner, policy_store, real_cluster):
    cluster = real_cluster
    pods = await _pods(make_spawner, policy_store)
    for ns in (NS, HUB_NS, OTHER_NS):
        cluster.ensure_namespace(ns)
    made = []
    try:
        for name, (ns, labels) in pods.items():
            # Only the labels matter to a selector; Kueue's queue labels are left off so no
            # Workload is made (the pods are stand-ins, not servers).
            labels = {k: v for k, v in labels.items() if not k.startswith("kueue.x-k8s.io/")}
            cluster.create(
                "pods",
                ns,
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": f"wall-{name}", "labels": labels},
                    "spec": real.restricted(
                        {
                            "containers": [{"name": "c", "image": "registry.example.com/stand-in:1"}],
                            "nodeSelector": {"gpuhub.io/no-such-node": "true"},
                        }
                    ),
                },
            )
            made.append((ns, f"wall-{name}"))
        # A real Job owns the policies, as the hub makes them (suspended: no pod of its own).
        owner = cluster.create(
            "jobs",
            NS,
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": "wall-owner"},
                "spec": {
                    "suspend": True,
                    "template": {
                        "spec": real.restricted(
                            {
                                "restartPolicy": "Never",
                                "containers": [{"name": "c", "image": "registry.example.com/stand-in:1"}],
                            }
                        )
                    },
                },
            },
        )
        api_ns = {n["metadata"]["name"]: n["metadata"].get("labels") or {} for n in cluster.list("namespaces")}
        report = []
        for kind, policies in _walls(pods).items():
            for p in policies:
                p = copy.deepcopy(p)
                p["metadata"]["ownerReferences"] = [
                    {"apiVersion": "batch/v1", "kind": "Job", "name": "wall-owner", "uid": owner["metadata"]["uid"]}
                ]
                r = cluster.session.post(
                    cluster.url + f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies", json=p, timeout=15
                )
                assert r.status_code == 201, r.text  # the API server's own validation
            inbound, outbound = [
                cluster.get(f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/{p['metadata']['name']}")
                for p in policies
            ]

            def asked(selector: dict, namespaces: list[str]) -> set[str]:
                """The pods the API server returns for ``selector`` in ``namespaces`` (stand-ins only)."""
                out = set()
                for ns in namespaces:
                    for pod in cluster.list("pods", ns, labelSelector=label_selector(selector)):
                        if pod["metadata"]["name"].startswith("wall-"):
                            out.add(pod["metadata"]["name"][len("wall-") :])
                return out

            def peer_pods(peer: dict) -> set[str]:
                if "namespaceSelector" in peer:
                    sel = label_selector(peer["namespaceSelector"])
                    namespaces = [n["metadata"]["name"] for n in cluster.list("namespaces", labelSelector=sel)]
                else:
                    namespaces = [NS]
                return asked(peer.get("podSelector") or {}, namespaces)

            targets = asked(inbound["spec"]["podSelector"], [NS])
            allowed = set().union(*(peer_pods(peer) for rule in inbound["spec"]["ingress"] for peer in rule["from"]))
            senders = asked(outbound["spec"]["podSelector"], [NS])
            receivers = set().union(*(peer_pods(peer) for rule in outbound["spec"]["egress"] for peer in rule["to"]))
            report.append(
                f"  {kind}: selects {sorted(targets)}; lets in {sorted(allowed)}; "
                f"lets {sorted(senders)} out to {sorted(receivers)}"
            )
            assert targets == EXPECTED_TARGETS[kind]
            assert allowed == EXPECTED_IN[kind], (kind, sorted(allowed))
            assert senders == EXPECTED_OUT_FROM and receivers == EXPECTED_TARGETS[kind]
            # the same answer as the selector logic the no-cluster test uses
            assert allowed == set().union(
                *(
                    _peer_matches(peer, pods, NS, lambda ns: api_ns.get(ns, {}))
                    for rule in inbound["spec"]["ingress"]
                    for peer in rule["from"]
                )
            )
        ray_policy = _ray_egress_policy()
        ray_selected = {
            p["metadata"]["name"][len("wall-") :]
            for p in cluster.list("pods", NS, labelSelector=label_selector(ray_policy["spec"]["podSelector"]))
            if p["metadata"]["name"].startswith("wall-")
        }
        report.append(f"  gpuhub-batch (egress): selects {sorted(ray_selected)}")
        assert ray_selected == BATCH_PODS
        print("\n[real] NetworkPolicy selectors asked of the API server:\n" + "\n".join(report))
        # Owned by the Job: the real garbage collector deletes them with it.
        cluster.session.delete(
            cluster.url + f"/apis/batch/v1/namespaces/{NS}/jobs/wall-owner", json={"propagationPolicy": "Background"}, timeout=15
        ).raise_for_status()
        names = [f"networkpolicy/{p['metadata']['name']}" for ps in _walls(pods).values() for p in ps]
        cluster.kubectl("-n", NS, "wait", "--for=delete", *names, "--timeout=60s")
    finally:
        for ns, name in made:
            cluster.delete("pods", ns, name, grace=0)
        cluster.kubectl(
            "-n",
            NS,
            "delete",
            "networkpolicy",
            "-l",
            "app.kubernetes.io/managed-by=gpuhub,gpuhub/wall-of",
            "--ignore-not-found",
            check=False,
        )
        cluster.kubectl("-n", NS, "delete", "job", "wall-owner", "--ignore-not-found", check=False)
        cluster.kubectl("delete", "namespace", OTHER_NS, "--ignore-not-found", "--wait=false", check=False)
