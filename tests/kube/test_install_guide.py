"""docs/install-kubernetes.md followed line by line, as far as this machine allows.

Every shell command in the guide's ``sh`` blocks is taken from the guide itself and either
run as written (``gpuhub ...``, ``kubectl create ... --dry-run=client``, ``kubectl get --raw``
against the API double), run with the one change that keeps it off a cluster (``helm
upgrade --install`` becomes ``helm template`` with the same values files; ``kubectl apply``
of a file goes to the API double, which validates it against the real CRDs, or through
Kubernetes' schema for kinds the double does not store), or listed as only read. The
only-read list must match docs/kubernetes-testing.md, so the closing note cannot forget one.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from double.harness import KUBECONFIG, NAMESPACE
from support.helm import helm_template, kubectl_binary, require_shared

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "install-kubernetes.md"
TESTING = REPO / "docs" / "kubernetes-testing.md"
GPUHUB = [sys.executable, "-m", "gpuhub_spawner.cli"]


def guide_commands() -> list[str]:
    """Logical shell commands of the guide's sh blocks (continuations and for-loops joined)."""
    commands, text = [], GUIDE.read_text()
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        current = ""
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).rstrip()
            if not line.strip():
                continue
            current = f"{current} {line.strip()}" if current else line.strip()
            if current.endswith("\\"):
                current = current[:-1].rstrip()
                continue
            if current.startswith("for ") and not current.endswith("done"):
                continue
            commands.append(re.sub(r" {2,}", " ", current))
            current = ""
    return commands


def only_read_in_testing_doc() -> list[str]:
    section = TESTING.read_text().split("## Install guide steps only read", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\* `(.+?)`", section, re.M)


def run(cmd, **kw):
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=kw.pop("cwd", REPO), **kw)
    assert done.returncode == 0, f"{cmd}: {done.stderr}"
    return done.stdout


def test_follow_the_guide_against_the_double(kube, tmp_path):
    chart = require_shared("charts", "jupyterhub-4.4.0")
    kube.reset()  # an empty cluster: the guide creates everything
    kube.call(lambda: setattr(kube, "webhook_namespaces", {NAMESPACE}))
    done, read_only = [], []
    for cmd in guide_commands():
        words = shlex.split(cmd.split("|")[0].split(">")[0].split("&&")[0])
        if words == ["gpuhub", "--help"]:
            assert "render" in run(GPUHUB + ["--help"])
        elif words[:2] == ["gpuhub", "validate"]:
            run(GPUHUB + words[1:])
        elif words[:3] == ["gpuhub", "render", "kueue"]:
            args = [str(tmp_path / w) if w == "live-localqueues.yaml" else w for w in words[1:]]
            out = run(GPUHUB + args)
            (tmp_path / "kueue.yaml").write_text(out)
            if "kubectl apply -f kueue.yaml" in cmd:
                kube.apply([d for d in yaml.safe_load_all(out) if d])
        elif cmd == "kubectl apply -f kueue.yaml":
            kube.apply([d for d in yaml.safe_load_all((tmp_path / "kueue.yaml").read_text()) if d])
        elif words[:3] == ["kubectl", "apply", "-f"] and words[3].startswith("helm-values/"):
            for doc in yaml.safe_load_all((REPO / words[3]).read_text()):
                kubernetes_validate.validate(doc, "1.30", strict=True)
        elif words[:3] == ["kubectl", "create", "configmap"] and "gpuhub-policy" in words:
            args = [w for w in words if w not in ("--dry-run=client", "-o", "yaml")]
            out = run([str(kubectl_binary())] + args[1:] + ["--dry-run=client", "-o", "yaml"], env={"KUBECONFIG": str(KUBECONFIG)})
            kubernetes_validate.validate(yaml.safe_load(out), "1.30", strict=True)
        elif words[:3] == ["kubectl", "get", "localqueues"]:
            live = {"apiVersion": "v1", "kind": "List", "items": kube.list("localqueues", NAMESPACE)}
            (tmp_path / "live-localqueues.yaml").write_text(yaml.safe_dump(live))
        elif words[:3] == ["helm", "upgrade", "--install"]:
            values = [REPO / w for prev, w in zip(words, words[1:]) if prev == "-f" and (REPO / w).exists()]
            assert [v.name for v in values] == ["values.yaml", "mlflow-values.yaml"]
            helm_template(chart, values, release=words[3], namespace=words[words.index("--namespace") + 1])
        elif words[:3] == ["kubectl", "get", "--raw"]:
            _pending_pod(kube)
            # kubectl sends no bearer token over plain HTTP: the double serves this read anonymously.
            kube.call(lambda: setattr(kube, "anonymous_reads", True))
            out = run([str(kubectl_binary()), "get", "--raw", words[3]], env={"KUBECONFIG": str(KUBECONFIG)})
            items = yaml.safe_load(out)["items"]
            assert items and items[0]["localQueueName"] == "vision" and items[0]["positionInLocalQueue"] == 0
        else:
            read_only.append(cmd)
            continue
        done.append(cmd)
    assert len(done) >= 10, done
    # The Kueue objects the guide applied admit a pod the way the hub will create them.
    assert {q["metadata"]["name"] for q in kube.list("localqueues", NAMESPACE)} == {"vision", "nlp", "students"}
    assert kube.invalid == []
    assert read_only == only_read_in_testing_doc(), "update docs/kubernetes-testing.md's list of steps only read"


def _pending_pod(kube):
    """A vision pod that cannot fit (3 A100 > nominal 2 + borrowing 1 in use) so the queue has one entry."""
    for i in range(4):
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"jupyter-u{i}", "labels": {"kueue.x-k8s.io/queue-name": "vision",
                                                               "component": "singleuser-server"}},
               "spec": {"containers": [{"name": "notebook", "image": "x", "command": ["sleep", "600"],
                                        "resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "1", "memory": "1Gi"}}}],
                        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}}}
        code, _ = kube.create("pods", NAMESPACE, pod)
        assert code == 201
    import time

    deadline = time.time() + 20
    while time.time() < deadline:
        gated = [p for p in kube.list("pods", NAMESPACE) if p["spec"].get("schedulingGates")]
        wl = [w for w in kube.list("workloads", NAMESPACE)
              if any(c["type"] == "QuotaReserved" and c["status"] == "False" for c in (w.get("status") or {}).get("conditions") or [])]
        if gated and wl:
            return
        time.sleep(0.1)
    pytest.fail("no pod waiting in the vision queue")
