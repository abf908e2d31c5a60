"""Fixtures for the notebook-side tests (helpers in ``nbside``)."""

from __future__ import annotations

import pytest
from nbside import HUB_TOKEN, SERVER_NAME, USER, VISIBLE, FakeNvml, HubStandIn, NotebookServer


@pytest.fixture(scope="session")
def fake_nvml(tmp_path_factory):
    return FakeNvml(tmp_path_factory.mktemp("nvml") / "nvml.json")


@pytest.fixture(scope="session")
def hub_stand_in():
    s = HubStandIn()
    yield s
    s.close()


@pytest.fixture(scope="session")
def nb_server(tmp_path_factory, fake_nvml, hub_stand_in):
    """What a gpuhub GPU server looks like: hub env, two of three GPUs, a named server."""
    server = NotebookServer(
        tmp_path_factory.mktemp("nbserver"),
        {
            "GPUHUB_FAKE_NVML": str(fake_nvml.path),
            "CUDA_VISIBLE_DEVICES": VISIBLE,
            "JUPYTERHUB_API_URL": hub_stand_in.api_url,
            "JUPYTERHUB_API_TOKEN": HUB_TOKEN,
            "JUPYTERHUB_USER": USER,
            "JUPYTERHUB_SERVER_NAME": SERVER_NAME,
        },
        base_url=f"/user/{USER}/{SERVER_NAME}/",
    ).start()
    yield server
    server.stop()


@pytest.fixture
def stand_in(hub_stand_in):
    hub_stand_in.reset()
    yield hub_stand_in
    hub_stand_in.reset()
