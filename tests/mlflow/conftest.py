"""One real hub (our config, our local spawner) with the real MLflow service, per module.

The service is wired with ``gpuhub_spawner.mlflow.configure`` exactly as the hub
config does; its removed-user sweep runs every 2 s here so revocation is observable.
"""

from __future__ import annotations

import pytest

from mlflow_service import POLICY, MlflowEndpoint, mlflow_extra_config
from support.hub import Hub
from support.ports import free_port


@pytest.fixture(scope="module")
def mlflow_hub(tmp_path_factory, request):
    service_port = free_port()
    # JupyterLab only for a module that opens it in a browser (JUPYTERLAB = True there)
    lab = getattr(request.module, "JUPYTERLAB", False)
    hub = Hub(tmp_path_factory.mktemp("mlflow-hub"), POLICY, extra_config=mlflow_extra_config(service_port), lab=lab)
    hub.start(timeout=90)
    endpoint = MlflowEndpoint(hub, service_port)
    try:
        yield hub, endpoint
    finally:
        hub.stop()


# What most modules here name them (a module with a hub of its own defines ``hub`` itself).
@pytest.fixture(scope="module")
def hub(mlflow_hub):
    return mlflow_hub[0]


@pytest.fixture(scope="module")
def mlflow(mlflow_hub):
    return mlflow_hub[1]
