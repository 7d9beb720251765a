"""Where checkpoints are and what their manifests say, without torch: the ``step_*``
directories under a root, the newest complete one, its ``manifest.json`` read and checked.

Torch-free so that ``dtp train --resume``'s preflight (:func:`dtp.cli.flags.preflight`)
can compare a checkpoint with the new flags before torch is imported;
:mod:`dtp.checkpoint.files` adds what needs torch (DCP's metadata, the files' CRC32s).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["FORMAT", "MANIFEST", "STEP_DIR", "checkpoints", "latest", "read_manifest", "open_checkpoint"]

FORMAT = 1  # manifest["format"]: bumped when the key scheme changes
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under ``root`` (a manifest is written last), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``root`` (``None`` if there is none).

    >>> latest("/nonexistent") is None
    True
    """
    found = checkpoints(Path(root))
    return found[-1] if found else None


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` (or of the newest one under it).
    ``ValueError`` if there is none or it is not a dtp checkpoint manifest."""
    return open_checkpoint(Path(path))[1]


def open_checkpoint(path: Path) -> tuple[Path, dict[str, Any]]:
    """Resolve, read and check what is on disk; raises ``ValueError`` naming the file."""
    if not (path / MANIFEST).is_file():
        found = latest(path)
        if found is None:
            raise ValueError(f"checkpoint: no checkpoint at {path} (no {MANIFEST} there, nor a step_* "
                             f"directory holding one)")
        path = found
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint: {path / MANIFEST} is unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "tensors" not in manifest:
        raise ValueError(f"checkpoint: {path / MANIFEST} is not a dtp checkpoint manifest of format {FORMAT}")
    return path, manifest
