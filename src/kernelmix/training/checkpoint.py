"""Checkpoints that survive a kill at any moment and never execute code when loaded.

A checkpoint is a directory ``<out_dir>/checkpoints/step_<N>/`` holding

* ``model.safetensors``: the weights (a tied LM head is stored once, as ``embed.weight``);
* ``state.pt``: optimizer and schedule state, step, tokens seen, every process's RNG states,
  loaded with ``torch.load(..., weights_only=True)``;
* ``config.json``: the resolved run config (plain JSON);
* ``manifest.json``: size and SHA-256 of each file above, written last.

Writing: everything goes into a fresh temporary directory next to the final one, every file is
fsynced, then the directory is renamed into place with ``os.replace`` (atomic on POSIX) and the
parent directory fsynced. A kill at any moment leaves either no ``step_<N>`` directory (only a
``.tmp-`` one, cleaned up by the next save) or a complete one; the previous checkpoint is only
deleted after the new one is in place. The manifest catches what atomicity cannot: a file
truncated or damaged later.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

FORMAT = 1
FILES = ("model.safetensors", "state.pt", "config.json")
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or from another run config."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    weights: dict[str, torch.Tensor]
    state: dict[str, Any]
    config: dict[str, Any]


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoint directories ``(step, path)``, oldest first (temporary ones are ignored)."""
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    found = list_checkpoints(out_dir)
    return found[-1][1] if found else None


# ---------------------------------------------------------------------------------------------
# Writing


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory file descriptors
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_weights(weights: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(path), metadata={"format": "pt"})


def write_state(state: dict[str, Any], path: Path) -> None:
    torch.save(state, path)


def write_json(data: Any, path: Path) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_checkpoint(
    out_dir: str | Path,
    step: int,
    weights: dict[str, torch.Tensor],
    state: dict[str, Any],
    config: dict[str, Any],
    *,
    keep: int = 2,
) -> Path:
    """Write a checkpoint atomically (see the module docstring) and delete all but the newest
    ``keep``. Call on one process only."""
    root = checkpoint_root(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write_weights(weights, tmp / "model.safetensors")
        write_state(state, tmp / "state.pt")
        write_json(config, tmp / "config.json")
        manifest = {
            "format": FORMAT,
            "step": step,
            "files": {name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)} for name in FILES},
        }
        write_json(manifest, tmp / "manifest.json")
        for name in (*FILES, "manifest.json"):
            _fsync_file(tmp / name)
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (e.g. a finished run resumed): swap it out
            stale = root / f".tmp-replaced-{final.name}-{uuid.uuid4().hex[:8]}"
            os.replace(final, stale)
            os.replace(tmp, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # Only now that the new checkpoint is durable may older ones (and debris of killed saves) go.
    for _, old in list_checkpoints(out_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for entry in root.iterdir():
        if entry.name.startswith(".tmp-"):
            shutil.rmtree(entry, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------------------
# Reading


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Verify a checkpoint directory against its manifest and load it (no code is executed:
    safetensors, ``weights_only`` torch.load, JSON). :class:`CheckpointError` says what is wrong
    and what to do about it."""
    path = Path(path)
    others = [p for _, p in list_checkpoints(path.parent.parent) if p != path]  # <out_dir>/checkpoints/step_N
    fallback = (
        f"delete {str(path)!r} to resume from the previous checkpoint {str(others[-1])!r}"
        if others
        else "start a fresh run with another --out (no earlier checkpoint is left)"
    )
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete (no manifest.json); {fallback}")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        step = int(manifest["step"])
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"checkpoint {str(path)!r} has an unreadable manifest.json ({error}); {fallback}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format {manifest.get('format')!r}, this kernelmix reads format {FORMAT}; "
            "resume it with the kernelmix version that wrote it"
        )
    for name in FILES:
        file = path / name
        expected = files.get(name, {})
        if not file.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is missing {name}; {fallback}")
        size = file.stat().st_size
        if size != expected.get("bytes"):
            raise CheckpointError(
                f"checkpoint file {str(file)!r} is truncated or corrupt: {size} bytes, the manifest says "
                f"{expected.get('bytes')}; {fallback}"
            )
        if _sha256(file) != expected.get("sha256"):
            raise CheckpointError(f"checkpoint file {str(file)!r} is corrupt (SHA-256 mismatch); {fallback}")
    try:
        from safetensors.torch import load_file

        weights = load_file(str(path / "model.safetensors"))
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except Exception as error:  # a file that matches its manifest but still does not parse
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be read ({error}); {fallback}") from error
    if state.get("step") != step:
        raise CheckpointError(f"checkpoint {str(path)!r}: state.pt is for step {state.get('step')}, the manifest says {step}")
    return Checkpoint(path=path, step=step, weights=weights, state=state, config=config)



def load_weights(model: nn.Module, weights: dict[str, torch.Tensor], path: Path) -> None:
    """Load a checkpoint's ``weights`` into ``model`` strictly; a tied LM head stored once (as the
    embedding) is filled in. A mismatch is a :class:`CheckpointError` naming ``path``."""
    weights = dict(weights)
    if model.config.tie_embeddings and "lm_head.weight" not in weights and "embed.weight" in weights:
        weights["lm_head.weight"] = weights["embed.weight"]  # stored once, see save
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as error:
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit this model: {error}") from None

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "checkpoint_root",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_weights",
    "save_checkpoint",
]
