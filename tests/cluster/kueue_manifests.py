#!/usr/bin/env python3
"""Kueue's own install objects, from the Kueue module's source (Go module proxy), for a
control plane whose processes run on this machine.

Reads ``config/components/webhook/manifests.yaml`` and the visibility APIService of
sigs.k8s.io/kueue (the module cache folder given as argv[1]) and writes, to stdout, what
Kueue's release ``manifests.yaml`` holds for them after its kustomize steps
(``config/default``: the ``kueue-`` name prefix, namespace ``kueue-system``, the
``namespaceSelector`` NotIn kube-system/kueue-system that ``config/components/webhook``
copies onto every job-framework webhook), with one change forced by having no Service
network here: each webhook's ``clientConfig.service`` becomes ``clientConfig.url`` on
https://127.0.0.1:<webhook port> with our own CA as ``caBundle``, and the visibility
Service is an ExternalName Service naming ``localhost`` (the API server resolves it to
https://localhost:<port>; Endpoints/EndpointSlices refuse loopback addresses).

The CRDs come first: the v0.19.2 CRDs of ``shared/schemas`` (the kinds gpuhub writes; the
same files as the module's ``config/components/crd/bases``) and the module's own for the
rest, each with the conversion webhook that ``config/components/crd`` patches in.

Usage: kueue_manifests.py KUEUE_MODULE_DIR WEBHOOK_PORT VISIBILITY_PORT CA_FILE [SHARED_CRD_DIR]
"""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import yaml

SELECTOR = {
    "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", "kueue-system"]}]
}


def crds(module: Path, shared: Path | None, webhook_port: str, ca: str) -> list[dict]:
    crd_dir = module / "config" / "components" / "crd"
    kustom = yaml.safe_load((crd_dir / "kustomization.yaml").read_text())
    converted = set()
    for patch in kustom.get("patches", []):
        doc = yaml.safe_load((crd_dir / patch["path"]).read_text())
        if doc.get("spec", {}).get("conversion", {}).get("strategy") == "Webhook":
            converted.add(doc["metadata"]["name"])
    out = []
    for res in kustom["resources"]:
        crd = yaml.safe_load((crd_dir / res).read_text())
        plural = crd["spec"]["names"]["plural"]
        if shared and (shared / f"{plural}.yaml").exists():
            crd = yaml.safe_load((shared / f"{plural}.yaml").read_text())
        if crd["metadata"]["name"] in converted:
            crd["spec"]["conversion"] = {
                "strategy": "Webhook",
                "webhook": {
                    "clientConfig": {"url": f"https://127.0.0.1:{webhook_port}/convert", "caBundle": ca},
                    "conversionReviewVersions": ["v1"],
                },
            }
        out.append(crd)
    return out


def main(module: str, webhook_port: str, visibility_port: str, ca_file: str, shared: str | None = None) -> None:
    cfg = Path(module) / "config" / "components"
    ca = base64.b64encode(Path(ca_file).read_bytes()).decode()
    kustom = yaml.safe_load((cfg / "webhook" / "kustomization.yaml").read_text())
    targets: set[str] = {"vpod.kb.io"}
    for rep in kustom.get("replacements", []):
        for target in rep["targets"]:
            for path in target["fieldPaths"]:
                targets.add(path.split("[name=")[1].split("]")[0])
    out = crds(Path(module), Path(shared) if shared else None, webhook_port, ca)
    out.append({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kueue-system"}})
    for doc in yaml.safe_load_all((cfg / "webhook" / "manifests.yaml").read_text()):
        if not doc or doc.get("kind") not in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            continue
        doc["metadata"]["name"] = "kueue-" + doc["metadata"]["name"]
        doc["metadata"].setdefault("labels", {})["app.kubernetes.io/name"] = "kueue"
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{webhook_port}{path}", "caBundle": ca}
            if hook["name"] in targets:
                hook["namespaceSelector"] = yaml.safe_load(yaml.safe_dump(SELECTOR))
        out.append(doc)
    api = yaml.safe_load((cfg / "visibility" / "apiservice_v1beta2.yaml").read_text())
    api["spec"]["service"] = {"name": "kueue-visibility-server", "namespace": "kueue-system", "port": int(visibility_port)}
    out.append(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": "kueue-visibility-server",
                "namespace": "kueue-system",
                "labels": {"app.kubernetes.io/name": "kueue"},
            },
            "spec": {
                "type": "ExternalName",
                "externalName": "localhost",
                "ports": [{"name": "https", "port": int(visibility_port), "protocol": "TCP"}],
            },
        }
    )
    out.append(api)
    yaml.safe_dump_all(out, sys.stdout, sort_keys=False)


if __name__ == "__main__":
    main(*sys.argv[1:6])
