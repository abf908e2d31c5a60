"""What the Kubernetes tests share, imported by name (never ``from conftest import``:
collected together with another test folder, ``conftest`` is whichever came first).

Importing this module points ``$KUBECONFIG`` at the file the API double will write:
kubernetes_asyncio reads it when it is imported, before any fixture runs.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace


REPO = Path(__file__).resolve().parents[3]
POLICY = REPO / "jupyterhub_config" / "profiles.yaml"
# The layout docs/install-kubernetes.md prescribes: the hub, proxy and image pullers in
# HUB_NAMESPACE (Kueue's webhook never called there), user pods and LocalQueues in NAMESPACE.
NAMESPACE = "gpuhub-users"
HUB_NAMESPACE = "gpuhub"
VENV_BIN = Path(sys.executable).parent


def shipped_container_security_context() -> dict:
    """``hub.config.KubeSpawner.container_security_context`` of helm-values/values.yaml: what
    every user pod's container carries in a real install (Pod Security ``restricted`` in the
    users' namespace, issue 40). Every test hub and spawner uses it, on both control planes."""
    import yaml

    values = yaml.safe_load((REPO / "helm-values" / "values.yaml").read_text())
    return values["hub"]["config"]["KubeSpawner"]["container_security_context"]


# A CI pod's service account must not be picked up: KubeSpawner prefers in-cluster config.
WORK = Path(tempfile.mkdtemp(prefix="gpuhub-kube-double-"))
WORK.chmod(0o755)  # not pytest's 0700 tmp dir: pod processes need to reach their HOME
atexit.register(shutil.rmtree, WORK, True)
KUBECONFIG = WORK / "kubeconfig"
if not os.environ.get("GPUHUB_TEST_KUBECONFIG"):
    os.environ["KUBECONFIG"] = str(KUBECONFIG)
    os.environ.pop("KUBERNETES_SERVICE_HOST", None)


class MockUser(SimpleNamespace):
    """The parts of ``jupyterhub.user.User`` a spawner touches."""

    def __init__(self, name, groups, **kw):
        super().__init__(
            name=name,
            escaped_name=name,
            id=abs(hash(name)) % 10000,
            url=f"/user/{name}/",
            groups=[SimpleNamespace(name=g) for g in groups],
            spawners={},
            **kw,
        )


class MockHub(SimpleNamespace):
    """The hub as a spawner sees it; its API root is answered by the double (version check)."""

    def __init__(self, base):
        super().__init__(public_host="", url=f"{base}/hub/", base_url="/hub/", api_url=f"{base}/hub/api")


def apply_policy(double, text: str) -> None:
    """A clean double holding the Kueue objects rendered from the policy ``text`` (as
    ``gpuhub render kueue`` writes them for an admin to apply)."""
    from gpuhub_spawner.kube.render import render_objects
    from gpuhub_spawner.policy.loader import parse_policy

    double.reset()
    double.apply(render_objects(parse_policy(text), NAMESPACE))
