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

Nothing non-finite is written: a checkpoint whose weights or optimizer state hold NaN or Inf is
refused before anything reaches the disk (resuming from it would only continue a diverged run).
A full disk or a directory we may not write is a :class:`CheckpointError` naming the path and the
fix; the previous checkpoint is untouched either way. Resuming reads the newest checkpoint that
verifies (:func:`load_latest_valid`): a damaged newest one is named in a warning and the one before
it is used.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import re
import shutil
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import KernelmixError
from ..oserror import from_safetensors
from ..output import file_sha256

FORMAT = 1
FILES = ("model.safetensors", "state.pt", "config.json")
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(KernelmixError):
    """A checkpoint is missing, incomplete, corrupt, from another run config, not finite, or
    cannot be written."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files are missing, truncated or corrupt; ``reason`` says which (without the fix)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


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
    """Complete checkpoint directories ``(step, path)``, oldest first (temporary ones are ignored).

    Args:
        out_dir: the run directory (checkpoints live in ``out_dir/checkpoints/step_<N>``).

    Returns:
        ``(step, path)`` pairs sorted by step; empty when there is no ``checkpoints`` directory."""
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
    """The newest checkpoint directory of a run (the highest step), whether or not it verifies.

    Args:
        out_dir: the run directory.

    Returns:
        Its path, or None when the run has no checkpoint."""
    found = list_checkpoints(out_dir)
    return found[-1][1] if found else None


# ---------------------------------------------------------------------------------------------
# Writing

# errno → what the user can do about it (anything else: a failing disk or filesystem)
_STORAGE_FIXES = {
    errno.ENOSPC: "free space or choose another --out",
    errno.EDQUOT: "free space (the disk quota is used up) or choose another --out",
    errno.EACCES: "make the directory writable or choose another --out",
    errno.EPERM: "make the directory writable or choose another --out",
    errno.EROFS: "the filesystem is read-only: choose another --out",
}


def storage_error(path: str | Path, error: OSError, what: str = "write", suffix: str = "") -> KernelmixError:
    """The :class:`CheckpointError` for an ``OSError`` met while writing ``path``: the path, the
    system's reason, and the fix (then ``suffix``)."""
    fix = _STORAGE_FIXES.get(error.errno, "check the disk, or choose another --out")
    reason = error.strerror or str(error)
    return CheckpointError(f"cannot {what} {str(path)!r}: {reason}; {fix}{suffix}")


@contextlib.contextmanager
def writing(path: str | Path, what: str = "write") -> Iterator[None]:
    """Turn an ``OSError`` inside the block (a full disk, no permission) into :func:`storage_error`."""
    try:
        yield
    except OSError as error:
        raise storage_error(path, error, what) from error


def _tensors(value: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside nested dicts/lists/tuples, with a dotted name."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{prefix}.{index}" if prefix else str(index))


def non_finite_tensors(weights: dict[str, torch.Tensor], state: dict[str, Any]) -> tuple[list[str], int]:
    """The names of the floating-point tensors of ``weights`` and ``state`` (the optimizer's
    moments, ...) that hold a NaN or an Inf, and how many floating-point tensors there are."""
    bad, count = [], 0
    for name, tensor in [*_tensors(weights, ""), *_tensors(state, "state")]:
        if tensor.is_floating_point() or tensor.is_complex():
            count += 1
            if not bool(torch.isfinite(tensor).all()):
                bad.append(name)
    return bad, count


def _refuse_non_finite(out_dir: str | Path, step: int, weights: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
    bad, count = non_finite_tensors(weights, state)
    if not bad:
        return
    previous = latest_checkpoint(out_dir)
    kept = f"the previous checkpoint {str(previous)!r} is intact" if previous else "there is no earlier checkpoint"
    shown = ", ".join(bad[:4]) + (", ..." if len(bad) > 4 else "")
    raise CheckpointError(
        f"refusing to write the checkpoint of step {step} in {str(out_dir)!r}: {len(bad)} of {count} tensors hold NaN "
        f"or Inf ({shown}), so the model diverged or a weight was corrupted; nothing was written and {kept}. Resume "
        "from it (--resume) or start again with a lower lr, grad_clip > 0 or without bf16"
    )


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


def write_weights(weights: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(path), metadata={"format": "pt"})
    except SafetensorError as error:
        # safetensors reports I/O failures as its own error type with the OS error in its text:
        # recover the OSError, so that a full disk reads as one (see storage_error)
        raise (from_safetensors(error) or OSError(errno.EIO, str(error), str(path))) from error


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
    ``keep``. Call on one process only. Non-finite tensors, a full disk or a directory that cannot
    be written raise :class:`CheckpointError`; the checkpoints already there stay as they were."""
    _refuse_non_finite(out_dir, step, weights, state)
    root = checkpoint_root(out_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}-{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        _write_files(tmp, step, weights, state, config)
        _move_into_place(tmp, final)
        _fsync_dir(root)
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(error, OSError):
            raise
        previous = latest_checkpoint(out_dir)
        kept = (f"; the previous checkpoint {str(previous)!r} is intact, continue from it with --resume"
                if previous is not None else "")
        raise storage_error(final, error, suffix=kept) from error
    # Only now that the new checkpoint is durable may others go: the oldest beyond ``keep``, debris
    # of killed saves, and any *newer* than this one, which can only be a damaged checkpoint that
    # a resumed run fell back from (load_latest_valid): this run has replaced it.
    found = list_checkpoints(out_dir)
    for found_step, old in found:
        if found_step > step:
            shutil.rmtree(old, ignore_errors=True)
    for _, old in [c for c in found if c[0] <= step][:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for entry in root.iterdir():
        if entry.name.startswith(".tmp-"):
            shutil.rmtree(entry, ignore_errors=True)
    return final


def _write_files(tmp: Path, step: int, weights: dict[str, torch.Tensor], state: dict[str, Any],
                 config: dict[str, Any]) -> None:
    write_weights(weights, tmp / "model.safetensors")
    write_state(state, tmp / "state.pt")
    write_json(config, tmp / "config.json")
    manifest = {
        "format": FORMAT,
        "step": step,
        "files": {name: {"bytes": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)} for name in FILES},
    }
    write_json(manifest, tmp / "manifest.json")
    for name in (*FILES, "manifest.json"):
        _fsync_file(tmp / name)
    _fsync_dir(tmp)


def _move_into_place(tmp: Path, final: Path) -> None:
    if final.exists():  # the same step saved again (e.g. a finished run resumed): swap it out
        stale = final.parent / f".tmp-replaced-{final.name}-{uuid.uuid4().hex[:8]}"
        os.replace(final, stale)
        os.replace(tmp, final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(tmp, final)


# ---------------------------------------------------------------------------------------------
# Reading


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Verify a checkpoint directory against its manifest and load it (no code is executed:
    safetensors, ``weights_only`` torch.load, JSON). :class:`CheckpointError` says what is wrong
    and what to do about it (:class:`CheckpointDamaged` for a missing, truncated or corrupt file).

    Args:
        path: a ``<out_dir>/checkpoints/step_<N>`` directory.

    Returns:
        The :class:`Checkpoint`: its path, step, weights and state (on the CPU) and config."""
    path = Path(path)
    others = [p for _, p in list_checkpoints(path.parent.parent) if p != path]  # <out_dir>/checkpoints/step_N
    fallback = (
        f"the previous checkpoint {str(others[-1])!r} is intact (--resume falls back to it by itself; to use it "
        f"elsewhere, delete {str(path)!r})"
        if others
        else "start a fresh run with another --out (no earlier checkpoint is left)"
    )

    def damaged(reason: str) -> CheckpointDamaged:
        return CheckpointDamaged(f"{reason}; {fallback}", reason=reason)

    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise damaged(f"checkpoint {str(path)!r} is incomplete (no manifest.json)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        step = int(manifest["step"])
    except (ValueError, KeyError, TypeError) as error:
        raise damaged(f"checkpoint {str(path)!r} has an unreadable manifest.json ({error})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format {manifest.get('format')!r}, this kernelmix reads format {FORMAT}; "
            "resume it with the kernelmix version that wrote it"
        )
    problem = _file_problem(path, files)
    if problem:
        raise damaged(problem)
    try:
        from safetensors.torch import load_file

        weights = load_file(str(path / "model.safetensors"))
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except pickle.UnpicklingError as error:
        if "weights only" not in str(error).lower():  # bytes that are no pickle at all: damaged
            raise damaged(f"checkpoint {str(path)!r} cannot be read ({error})") from error
        # weights_only refused a Python object: not what kernelmix writes, and never unpickled
        instead = (f"delete {str(path)!r} and --resume continues from {str(others[-1])!r}" if others
                   else "start a fresh run with another --out")
        raise CheckpointError(unsafe_pickle_message(path / "state.pt", error, instead)) from None
    except Exception as error:  # a file that matches its manifest but still does not parse
        raise damaged(f"checkpoint {str(path)!r} cannot be read ({error})") from error
    if state.get("step") != step:
        raise damaged(f"checkpoint {str(path)!r}: state.pt is for step {state.get('step')}, the manifest says {step}")
    return Checkpoint(path=path, step=step, weights=weights, state=state, config=config)


def unsafe_pickle_message(file: Path, error: Exception, instead: str) -> str:
    """Why a pickle that ``torch.load(weights_only=True)`` refused is not loaded: it holds Python
    objects beyond tensors and plain data, and unpickling them could run code. torch's own text
    advises ``weights_only=False``; that advice is never passed on."""
    found = re.search(r"GLOBAL ([\w.]+)", str(error)) or re.search(r"global ['\"]?([\w.]+)", str(error))
    what = f" (it names {found.group(1)!r})" if found else ""
    return (f"{str(file)!r} is refused for safety: it is a pickle holding Python objects other than tensors and plain "
            f"data{what}, which kernelmix never unpickles since loading them could run code; kernelmix does not write "
            f"such files, so it came from elsewhere: {instead}")


def _file_problem(path: Path, files: dict[str, Any]) -> str | None:
    """What is wrong with a checkpoint's files against its manifest (None: nothing)."""
    for name in FILES:
        file = path / name
        expected = files.get(name, {})
        if not file.is_file():
            return f"checkpoint {str(path)!r} is missing {name}"
        size = file.stat().st_size
        if size != expected.get("bytes"):
            return (f"checkpoint file {str(file)!r} is truncated or corrupt: {size} bytes, "
                    f"the manifest says {expected.get('bytes')}")
        if file_sha256(file) != expected.get("sha256"):
            return f"checkpoint file {str(file)!r} is corrupt (SHA-256 mismatch)"
    return None


def load_latest_valid(out_dir: str | Path, *, warn: bool = True) -> Checkpoint | None:
    """The newest checkpoint of ``out_dir`` that verifies (None when there is none at all).
    Damaged newer ones are skipped with a warning naming them and what is wrong (``warn``); the
    resumed run's next checkpoint replaces them (:func:`save_checkpoint`). When every checkpoint is
    damaged, the newest one's error is raised (with several, one error naming them all); any other
    :class:`CheckpointError` (a checkpoint of another format) is raised as it is, since an older one
    would silently lose its progress.

    Args:
        out_dir: the run directory.
        warn: warn about the damaged checkpoints skipped.

    Returns:
        The loaded :class:`Checkpoint`, or None when the run has no checkpoint."""
    damaged: list[CheckpointDamaged] = []
    for _, path in reversed(list_checkpoints(out_dir)):
        try:
            ckpt = load_checkpoint(path)
        except CheckpointDamaged as error:
            damaged.append(error)
            continue
        if damaged and warn:
            warnings.warn(f"{'; '.join(e.reason for e in damaged)}: resuming from the newest valid checkpoint "
                          f"{str(path)!r} instead (the damaged one is replaced by the next checkpoint)", stacklevel=2)
        return ckpt
    if len(damaged) == 1:
        raise damaged[0]
    if damaged:
        raise CheckpointDamaged(f"every checkpoint of {str(out_dir)!r} is damaged "
                                f"({'; '.join(e.reason for e in damaged)}); start a fresh run with another --out",
                                reason="every checkpoint is damaged")
    return None


def load_weights(model: nn.Module, weights: dict[str, torch.Tensor], path: Path) -> None:
    """Load a checkpoint's ``weights`` into ``model`` strictly; a tied LM head stored once (as the
    embedding) is filled in. A mismatch is a :class:`CheckpointError` naming ``path``.

    Args:
        model: the :class:`~kernelmix.model.CausalLM` to fill (``config.tie_embeddings`` says whether its
            head is the embedding).
        weights: the checkpoint's tensors by name (:attr:`Checkpoint.weights`).
        path: the checkpoint directory, for the error message.

    Returns:
        None; the model's parameters and buffers are set in place."""
    weights = dict(weights)
    if model.config.tie_embeddings and "lm_head.weight" not in weights and "embed.weight" in weights:
        weights["lm_head.weight"] = weights["embed.weight"]  # stored once, see save
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as error:
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit this model: {error}") from None

__all__ = [
    "Checkpoint",
    "CheckpointDamaged",
    "CheckpointError",
    "checkpoint_root",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest_valid",
    "load_weights",
    "non_finite_tensors",
    "save_checkpoint",
    "storage_error",
    "writing",
]
