"""gpuhub: a multi-user JupyterHub for teams that share GPUs.

One policy core (``gpuhub_spawner.policy``) drives two backends: the one-machine
spawner (``gpuhub_spawner.local``) where admission happens in the hub, and the
KubeSpawner subclass (``gpuhub_spawner.kube``) where Kueue admits.
"""

__version__ = "0.1.0"
