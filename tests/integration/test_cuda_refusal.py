"""A profile whose CUDA the GPUs' driver cannot run is refused before it queues (issue 28
item 3), against a real hub run as root with the fake ``pynvml`` (tests/support/fake_nvml)
standing in for a driver that supports CUDA 12.2: alice's PyTorch-for-CUDA-12.8 server and job
are refused with the need, the driver and what to do, and nothing of hers waits in the queue;
the profile built for CUDA 12.0 starts a real server on the same GPU.
"""

from __future__ import annotations

import json
import os

import pytest

from support.fake_gpus import fake_nvml_env
from support.hub import Hub

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="jobs run as their user's account: needs a hub running as root"),
]


POLICY = """\
flavors:
  - name: a100
    displayName: A100
    local: {match: Fake}
teams:
  - name: vision
    displayName: Vision Lab
    groups: [vision-lab]
    quota: {gpus: {a100: 1}}
profiles:
  - {slug: torch-cu128, displayName: PyTorch (CUDA 12.8), cpu: 1, memory: 1Gi,
     gpu: {count: 1, flavor: a100, cuda: "12.8"}, teams: [vision]}
  - {slug: torch-cu120, displayName: PyTorch (CUDA 12.0), cpu: 1, memory: 1Gi,
     gpu: {count: 1, flavor: a100, cuda: "12.0"}, teams: [vision]}
"""

REFUSED = (
    "PyTorch (CUDA 12.8) needs CUDA 12.8, but this machine's NVIDIA driver 535.183.01 supports CUDA 12.2 at "
    "most: its GPU code would fail to start. Choose another profile, or ask an admin to update the driver."
)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    nvml = tmp_path_factory.mktemp("nvml") / "nvml.json"
    nvml.write_text(
        json.dumps(
            {
                "devices": [{"uuid": "GPU-fake-0", "name": "NVIDIA Fake A100", "memory_total": 80 * 2**30, "utilization": 0}],
                "driver": {"version": "535.183.01", "cuda": 12020},
            }
        )
    )
    h = Hub(tmp_path_factory.mktemp("cuda"), POLICY, env=fake_nvml_env(nvml)).start()
    yield h
    h.stop()


def test_a_profile_the_driver_cannot_run_is_refused_with_the_reason_and_the_other_starts(hub):
    alice = hub.login("alice")
    r = alice.start("torch-cu128")
    assert r.status_code == 409, r.text
    assert r.json()["message"] == REFUSED
    assert alice.server() is None  # nothing of hers is left pending or waiting
    # A batch job with that profile is refused the same way, before anything queues.
    spec = "name: train\nprofile: torch-cu128\ncommand: [python, -c, 'print(1)']\n"
    r = alice.api.post(alice.url("/gpuhub/jobs"), json={"spec": spec, "filename": "job.yaml"})
    assert r.status_code == 409 and r.json()["message"] == REFUSED, r.text
    assert alice.api.get(alice.url("/gpuhub/jobs")).json()["jobs"] == []
    # The profile the driver can run gets the GPU and a real server.
    r = alice.start("torch-cu120")
    assert r.status_code in (201, 202), r.text
    alice.wait_ready()
    env = alice.server_env()
    assert env["GPUHUB_PROFILE"] == "torch-cu120" and env["CUDA_VISIBLE_DEVICES"] == "GPU-fake-0"
    alice.stop()
    alice.wait_gone()
