"""The policy's ``ray:`` section (docs/ray.md) and what a Ray cluster request may ask for."""

import pytest

from gpuhub_spawner.policy import PolicyError, parse_policy
from gpuhub_spawner.policy.access import ChoiceError
from gpuhub_spawner.rayclusters import RayRequest, choose

BASE = """\
flavors:
  - name: a100
    local: {virtual: 2}
teams:
  - name: vision
    groups: [vision-lab]
    quota:
      gpus:
        a100: {nominal: 2}
profiles:
  - slug: gpu
    displayName: One GPU
    gpu: {count: 1, flavor: a100}
    teams: [vision]
  - slug: gpu2
    displayName: Two GPUs
    gpu: {count: 2, flavor: a100}
    teams: [vision]
"""


def errors(text):
    with pytest.raises(PolicyError) as e:
        parse_policy(text, "p.yaml")
    return [i.format("p.yaml") for i in e.value.issues]


def test_defaults_are_off_and_documented_values():
    ray = parse_policy(BASE).ray
    assert (ray.enabled, ray.stop_with_server, ray.max_workers, ray.autoscaling, ray.image) == (False, True, 4, False, None)
    assert (ray.head_resources.cpu, ray.head_resources.memory) == (1000, 2 * 2**30)


def test_section_reads_camel_case_and_quantities():
    ray = parse_policy(
        BASE + "ray:\n  enabled: true\n  stopWithServer: false\n  maxWorkers: 7\n"
        "  headResources: {cpu: 500m, memory: 4Gi}\n  image: ghcr.io/lab/ray:2.52\n"
    ).ray
    assert (ray.enabled, ray.stop_with_server, ray.max_workers) == (True, False, 7)
    assert (ray.head_resources.cpu, ray.head_resources.memory, ray.image) == (500, 4 * 2**30, "ghcr.io/lab/ray:2.52")


def test_mistakes_are_located():
    assert errors(BASE + "ray: {enabled: true, maxWorkers: 8}\n") == ["p.yaml:19:34: ray.maxWorkers: must be at most 7 (got 8)"]
    assert errors(BASE + "ray:\n  stopwithServer: false\n") == [
        "p.yaml:20:3: ray.stopwithServer: unknown key 'stopwithServer' (did you mean 'stopWithServer'?)"
    ]
    (msg,) = errors(BASE + "ray:\n  headResources: {cpu: lots}\n")
    assert msg.startswith("p.yaml:20:24: ray.headResources.cpu: 'lots' is not a quantity")


def test_request_picks_the_profile_by_gpu_count_and_checks_the_section():
    on = parse_policy(BASE + "ray: {enabled: true, maxWorkers: 2}\n")
    assert choose(on, ["vision-lab"], RayRequest(user="ada", gpus=2)).profile.slug == "gpu2"
    assert choose(on, ["vision-lab"], RayRequest(user="ada", profile="gpu")).gpus == 1
    refused = {
        "off": (parse_policy(BASE), RayRequest(user="ada", gpus=1), "Ray clusters are not enabled on this hub"),
        "workers": (on, RayRequest(user="ada", gpus=1, workers=3), "at most 2 workers"),
        "count": (
            on,
            RayRequest(user="ada", gpus=3),
            "No profile of your team(s) has 3 GPU(s); the counts you may ask for are 1, 2",
        ),
        "mismatch": (on, RayRequest(user="ada", gpus=2, profile="gpu"), "Profile 'gpu' has 1 GPU(s), not 2"),
        "name": (on, RayRequest(user="ada", gpus=1, name="Bad Name"), "is not a cluster name"),
    }
    for what, (policy, request, words) in refused.items():
        with pytest.raises(ChoiceError) as e:
            choose(policy, ["vision-lab"], request)
        assert words in e.value.message, what
    with pytest.raises(ChoiceError) as e:
        choose(on, ["nobody"], RayRequest(user="eve", gpus=1))
    assert e.value.status == 403


def test_gpus_are_split_among_workers_or_held_by_the_head():
    from gpuhub_spawner.rayclusters.node import shares

    assert shares(["GPU-a", "GPU-b"], 2, 0) == [["GPU-a", "GPU-b"]]
    assert shares(["GPU-a", "GPU-b", "GPU-c"], 3, 2) == [["GPU-a", "GPU-c"], ["GPU-b"]]
    assert shares([], 0, 1) == [[]]


def test_a_clusters_ports_never_repeat_even_when_the_kernel_reuses_a_closed_port(monkeypatch):
    """CI saw a head refuse to start ("runtime_env_agent is trying to use a port number 36723
    that is used by other components"): its ports came from two draws, and the kernel handed a
    port of the first, closed, draw out again. Here a kernel that always reuses the lowest
    closed port: every port of a 2-worker cluster is still different."""
    import socket as real_socket

    from gpuhub_spawner.rayclusters import node

    bound: set[int] = set()

    class ReusingSocket:
        def bind(self, addr):
            self.port = next(p for p in range(20000, 30000) if p not in bound)
            bound.add(self.port)

        def getsockname(self):
            return ("127.0.0.1", self.port)

        def close(self):
            bound.discard(self.port)

    monkeypatch.setattr(node.socket, "socket", ReusingSocket)
    head, nodes = node.cluster_ports(workers=2)
    monkeypatch.setattr(node.socket, "socket", real_socket.socket)
    every = head + [p for ports in nodes for p in ports]
    assert len(nodes) == 3 and all(len(ports) == len(node.NODE_PORTS) for ports in nodes)
    assert len(set(every)) == len(every), every
    flags = node.node_ports(nodes[1])
    assert flags[:2] == ["--node-ip-address", "127.0.0.1"] and flags[3] == str(nodes[1][0])


def test_the_cluster_is_ready_once_ray_start_has_finished_not_when_its_ports_listen():
    """Fresh-clone run 37 (2026-12-05): the launcher said "ready" once the head's GCS and dashboard listened, but
    ``ray start --head`` records the cluster for a plain ``ray.init()`` only after its raylet
    is up; alice's kernel, a moment too early, started a Ray of its own without GPUs and her
    2-GPU task waited until the idle rule stopped her real cluster. The launcher now waits for
    the head's own "Ray runtime started.", which ``ray start`` prints once its node is up and
    just before it records the cluster. Checked against the installed Ray's source: a Ray that
    said it elsewhere, or not at all, would leave every cluster "starting" for 10 minutes."""
    import inspect
    import io
    import re
    import threading

    scripts = pytest.importorskip("ray.scripts.scripts")
    from gpuhub_spawner.rayclusters import node

    source = inspect.getsource(scripts.start.callback)
    said = [m.start() for m in re.finditer(r'startup_msg = "Ray runtime started\."', source)]
    assert len(said) == 2, "ray start no longer says 'Ray runtime started.' for the head and for a worker"
    assert all(at < source.index("write_ray_address(") for at in said), "Ray now records the cluster before it says so"

    class Head:  # a head's output, as the launcher reads it through its pipe
        stdout = io.StringIO("Local node IP: 127.0.0.1\n--------------------\nRay runtime started.\n")

    started = threading.Event()
    node._pump(Head(), started)  # type: ignore[arg-type]
    assert started.is_set()


def test_jobs_and_clusters_are_capped_by_gpus_not_by_servers():
    """``check_job_caps``, which every job and Ray manager calls: an open notebook (the team's
    ``maxServers: 1`` reached) does not refuse a cluster, the GPU cap still does."""
    from gpuhub_spawner.policy.access import check_job_caps, check_user_caps, resolve_choice

    policy = parse_policy(
        BASE.replace("        a100: {nominal: 2}\n", "        a100: {nominal: 2}\n    perUser: {maxServers: 1, maxGPUs: 2}\n")
    )
    choice = resolve_choice(policy, ["vision-lab"], {"profile": "gpu"})
    notebook = [None]  # a server with no GPU: the one server the team allows
    with pytest.raises(ChoiceError, match="allows 1 server"):
        check_user_caps(choice, notebook)  # a second server is refused ...
    check_job_caps(choice, notebook)  # ... a job or cluster beside it is not
    with pytest.raises(ChoiceError, match="allows 2 GPU") as e:
        check_job_caps(choice, notebook + [policy.profile("gpu2")])  # but 2 + 1 GPUs is over the cap
    assert e.value.status == 403
    assert choice.team.per_user.max_servers == 1  # the policy's team is left as it was
