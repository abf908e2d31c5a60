"""gpuhub's notebook-side package: runs inside every single-user server.

Modules:
  identity        who/where this server is (the GPUHUB_* variables the hub sets)
  gitinfo         commit and dirty flag of the repository a notebook lives in
  mlflow_context  MLflow run-context provider: tags every run (entry point
                  ``mlflow.run_context_provider``), turns on system metrics on GPU servers
  mlflow_auth     MLflow request-header provider: sends this server's hub token to
                  the hub's MLflow service only (entry point ``mlflow.request_header_provider``)

  activity          GPUs (nvidia-ml-py), kernels and terminals of this server, for the culler
  server_extension  Jupyter server extension: ``gpuhub/activity`` for the hub's culler and
                    ``gpuhub/culling`` (cull warning + snooze relay) for the lab extension
  raycluster        ``ray_cluster(gpus=2)``: a Ray cluster from the team's queue (docs/ray.md)
  ray_dashboard     ``gpuhub/ray/<name>/dashboard/``: the user's Ray dashboard on the user's
                    origin, behind the server's own hub login (docs/ray.md)
  labextension/     the prebuilt JupyterLab extension (cull-warning notification with Snooze);
                    source in ``images/gpuhub-notebook/labextension``

Nothing here imports MLflow or Jupyter at package import time.
"""

__version__ = "0.1.0"


def ray_cluster(*args, **kwargs):
    """``with gpuhub_notebook.ray_cluster(gpus=2) as address: ray.init(address)`` (docs/ray.md)."""
    from .raycluster import ray_cluster as _ray_cluster

    return _ray_cluster(*args, **kwargs)


def _jupyter_server_extension_points():
    return [{"module": "gpuhub_notebook"}]


def _link_jupyter_server_extension(serverapp):
    # In the link phase, before any extension loads: the terminals extension reads
    # terminado_settings when it loads.
    from .server_extension import plain_terminal_shell

    plain_terminal_shell(serverapp)


def _load_jupyter_server_extension(serverapp):
    from .ray_dashboard import load as load_ray_dashboard
    from .server_extension import load

    load(serverapp)
    load_ray_dashboard(serverapp)


def _jupyter_labextension_paths():
    return [{"src": "labextension", "dest": "gpuhub-notebook"}]
