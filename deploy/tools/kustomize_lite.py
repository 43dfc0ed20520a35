#!/usr/bin/env python3
"""A tiny renderer for the kustomize features deploy/ uses, for machines without
kustomize or kubectl (CI): `resources` (files and directories), `namespace`, `images`,
`configMapGenerator` (files/literals, labels, with disableNameSuffixHash) and `patches`
given as strategic-merge patch files. Anything else raises, so a kustomization that
outgrows this subset fails loudly instead of rendering wrongly. tests/test_deploy.py
checks that it renders exactly what `kubectl kustomize` renders wherever kubectl exists.

    python deploy/tools/kustomize_lite.py deploy/overlays/cpu > cpu.yaml
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "images", "configMapGenerator", "patches"}
CLUSTER_SCOPED = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PriorityClass",
    "StorageClass", "PersistentVolume", "APIService", "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration", "RuntimeClass", "IngressClass",
}
# strategic-merge list merge keys (the subset of Kubernetes' patchMergeKey we meet);
# lists of other keys, or of scalars, are replaced as a whole
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "ports": "containerPort", "imagePullSecrets": "name"}


class Unsupported(ValueError):
    pass


def render(directory: str | Path) -> list[dict]:
    d = Path(directory)
    k = yaml.safe_load((d / "kustomization.yaml").read_text())
    unknown = set(k) - SUPPORTED
    if unknown:
        raise Unsupported(f"{d}: kustomization fields not supported: {sorted(unknown)}")
    docs: list[dict] = []
    for entry in k.get("resources", []):
        path = d / entry
        if path.is_dir():
            docs += render(path)
        else:
            docs += [x for x in yaml.safe_load_all(path.read_text()) if x]
    for gen in k.get("configMapGenerator", []):
        docs.append(_configmap(d, gen))
    for patch in k.get("patches", []):
        if set(patch) != {"path"}:
            raise Unsupported(f"{d}: only `patches: - path: FILE` (strategic merge) is supported")
        for p in yaml.safe_load_all((d / patch["path"]).read_text()):
            _apply_patch(docs, p, d / patch["path"])
    if "namespace" in k:
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc.setdefault("metadata", {})["namespace"] = k["namespace"]
    for image in k.get("images", []):
        for doc in docs:
            _set_image(doc, image)
    return docs


def _configmap(d: Path, gen: dict) -> dict:
    opts = gen.get("options", {})
    if not opts.get("disableNameSuffixHash"):
        raise Unsupported(f"{d}: configMapGenerator {gen['name']}: needs options.disableNameSuffixHash")
    if set(gen) - {"name", "files", "literals", "options"} or set(opts) - {"disableNameSuffixHash", "labels", "annotations"}:
        raise Unsupported(f"{d}: configMapGenerator {gen['name']}: unsupported fields")
    data = {}
    for f in gen.get("files", []):
        key, _, path = f.rpartition("=") if "=" in f else (Path(f).name, "", f)
        data[key] = (d / path).read_text()
    for lit in gen.get("literals", []):
        key, _, value = lit.partition("=")
        data[key] = value
    meta: dict[str, Any] = {"name": gen["name"]}
    if opts.get("labels"):
        meta["labels"] = dict(opts["labels"])
    if opts.get("annotations"):
        meta["annotations"] = dict(opts["annotations"])
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def _apply_patch(docs: list[dict], patch: dict, source: Path) -> None:
    name = patch.get("metadata", {}).get("name")
    targets = [x for x in docs if x.get("kind") == patch.get("kind") and x.get("metadata", {}).get("name") == name]
    if len(targets) != 1:
        raise Unsupported(f"{source}: patch matches {len(targets)} resources ({patch.get('kind')}/{name})")
    merged = strategic_merge(targets[0], patch)
    targets[0].clear()
    targets[0].update(merged)


def strategic_merge(base: Any, patch: Any, key: str = "") -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if isinstance(v, dict) and "$patch" in v or k.startswith("$"):
                raise Unsupported(f"strategic-merge directive under {k!r}")
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = strategic_merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        mk = MERGE_KEYS[key]
        if all(isinstance(x, dict) and mk in x for x in base + patch):
            # as kustomize orders them: the patch's items (merged into the base's
            # item of the same key), then the base's items the patch did not name
            originals = {x[mk]: x for x in base}
            out = [strategic_merge(originals[x[mk]], x) if x[mk] in originals else copy.deepcopy(x) for x in patch]
            named = {x[mk] for x in patch}
            return out + [copy.deepcopy(x) for x in base if x[mk] not in named]
    return copy.deepcopy(patch)


def _set_image(doc: dict, image: dict) -> None:
    spec = doc.get("spec", {}).get("template", {}).get("spec") or (doc.get("spec") if doc.get("kind") == "Pod" else None)
    if not spec:
        return
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        ref = c.get("image", "")
        name, tag = (ref.rsplit(":", 1) + [""])[:2] if ":" in ref.rsplit("/", 1)[-1] else (ref, "")
        if name != image["name"]:
            continue
        name = image.get("newName", name)
        tag = image.get("newTag", tag)
        c["image"] = f"{name}:{tag}" if tag else name


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    yaml.safe_dump_all(render(argv[0]), sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
