"""Where a model comes from: an offline alias (`minilm-l6`, `assets.fetch`), a local directory, or
a hub id (`huggingface_hub.snapshot_download`, when the hub is reachable); and back from a model
directory to the hub id that names it elsewhere (`hub_id`)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from fedjax_split import assets
from fedjax_split.errors import UserError
from fedjax_split.models.weight_files import WEIGHT_FILES

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# a model in the hub's cache: .../models--ORG--NAME/snapshots/REVISION (huggingface_hub's layout)
_HUB_SNAPSHOT = re.compile(r"(?:^|/)models--([^/]+)/snapshots/[^/]+/?$")


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """Model directory for an offline alias (`minilm-l6`), a local directory, or a hub id."""
    name = str(name_or_path)
    model_aliases = sorted(k for k, a in assets.ASSETS.items() if a.root)
    if name in model_aliases:
        return assets.fetch(name)
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{path} is a file; pass the checkpoint directory that contains it")
        return path
    if not _HUB_ID.match(name) or name.startswith((".", "/", "~")):
        raise UserError(
            f"model {name!r} not found: not a local directory, an offline alias {model_aliases} "
            "or a hub id; check the path"
        )
    return _snapshot(name, model_aliases)


def _snapshot(repo_id: str, aliases: list[str]) -> Path:
    try:
        from huggingface_hub import snapshot_download

        d = Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.txt", "*.safetensors"]))
        if not any((d / f).is_file() for f in WEIGHT_FILES[:2]):
            d = Path(
                snapshot_download(repo_id, allow_patterns=["*.json", "*.txt", "pytorch_model.bin"])
            )
    except Exception as e:  # hub errors come in many types (HTTP, offline, not found, timeouts)
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UserError(
            f"could not get {repo_id!r} from the Hugging Face hub ({why}); check the id and "
            "network,"
            f" or pass a local checkpoint directory or an offline alias {aliases}"
        ) from None
    return d


def hub_id(model: str | None, model_dir: str | os.PathLike[str] | None) -> str | None:
    """The Hugging Face hub id of the model a run started from, or None (a model of its own):
    what a PEFT adapter names as its base so that it loads elsewhere. From `model` as the run was
    given it (config.json's `model`): an offline alias of a hub model (`minilm-l6`), or a hub id
    that the hub resolved (it named no local directory: `model_dir`, where the run loaded it, is
    elsewhere). Else from `model_dir`: a snapshot in the hub's cache (`models--ORG--NAME/...`),
    or a known offline copy (a model asset's weights, by size and sha256)."""
    if model:
        if model in assets.ASSETS and assets.ASSETS[model].hub_id:
            return assets.ASSETS[model].hub_id
        local = model_dir is not None and Path(model).expanduser() == Path(model_dir)
        if _HUB_ID.match(model) and not local and model not in assets.ASSETS:
            return model
    if model_dir is None:
        return None
    if m := _HUB_SNAPSHOT.search(Path(model_dir).as_posix()):
        return m.group(1).replace("--", "/")  # the hub allows no "--" within an id's parts
    weights = Path(model_dir) / "model.safetensors"
    for asset in assets.ASSETS.values():
        pinned = asset.files.get(f"{asset.root}/model.safetensors")
        if asset.hub_id and pinned and weights.is_file() and weights.stat().st_size == pinned[1]:
            if assets.sha256_file(weights) == pinned[0]:
                return asset.hub_id
    return None
