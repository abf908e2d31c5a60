"""Central MLflow for gpuhub: the hub-managed service (``python -m gpuhub_spawner.mlflow``:
``service.py``, the authenticating proxy ``proxy.py``, the tracking server ``upstream.py``,
accounts and secrets). The hub config wires it in with ``gpuhub_spawner.wiring.mlflow.configure``
(the composition root; see docs/mlflow.md).
"""
