"""Where a checkpoint is: a local file or directory, or a Hugging Face Hub id fetched into the HF cache."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import CheckpointError

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(/[\w./-]+)?")
_CHECKPOINT_SUFFIXES = (".pth", ".pt", ".safetensors", ".bin", ".gguf", ".pte")


def _path_like(text: str) -> bool:
    """An argument meant as a local path, not a hub id: it starts with ./ / ~, its first folder
    exists here, or it is `folder/file` with a checkpoint suffix (a hub id names a file only
    after `org/name/`)."""
    if text.startswith((".", "/", "~")) or not _HUB_ID.fullmatch(text):
        return True
    parts = text.split("/")
    return Path(parts[0]).is_dir() or (len(parts) == 2 and parts[1].lower().endswith(_CHECKPOINT_SUFFIXES))


def resolve(path_or_id: str | os.PathLike) -> Path:
    """A local path, or a hub id `org/name` (or `org/name/file.pth`) fetched into the HF cache."""
    path = Path(path_or_id).expanduser()
    if path.exists():
        return path
    text = str(path_or_id)
    if _path_like(text):
        raise CheckpointError(f"{text}: no such file or directory")
    try:
        import huggingface_hub as hub

        parts = text.split("/")
        repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
        if filename:
            return Path(hub.hf_hub_download(repo, filename))
        files = hub.list_repo_files(repo)
        if "config.json" not in files:
            weights = [f for f in files if f.endswith((".pth", ".safetensors", ".bin"))]
            raise CheckpointError(
                f"{text}: the hub repository has no config.json; name one checkpoint file in it, "
                f"e.g. {repo}/{weights[0] if weights else 'FILE.pth'}"
            )
        patterns = ["*.json", "*.txt", "*.safetensors"]
        if not any(f.endswith(".safetensors") for f in files):
            patterns.append("*.bin")
        return Path(hub.snapshot_download(repo, allow_patterns=patterns))
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"{text}: not a local file, and fetching it from the Hugging Face Hub failed ({type(e).__name__}: "
            f"{str(e)[:300]}). A local file: check the path. No network: HF_HUB_OFFLINE=1 uses only what is "
            f"cached; or download it elsewhere (huggingface-cli download {'/'.join(text.split('/')[:2])} "
            "--local-dir DIR) and pass DIR"
        ) from None
