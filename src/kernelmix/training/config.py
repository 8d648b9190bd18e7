"""The training configuration: one plain dataclass, read from a TOML/YAML/JSON file and/or
``key=value`` overrides.

    config = TrainConfig(preset="tiny", steps=200, model={"mixer": "cubit"})
    config = build_config("run.toml", ["model.mixer=cubit", "lr=3e-4", "model.mixer_options.cubit.lrr=false"])

A file holds the fields of :class:`TrainConfig` at the top level and the model overrides in a
``model`` table (any :class:`~kernelmix.model.ModelConfig` field)::

    preset = "small"
    steps = 2000
    lr = 1e-3
    [model]
    mixer = "cubit"
    mixer_options = { cubit = { lrr = false } }

The resolved config a run saves (``config.json``: ``{"format", "train", "model", ...}``) is accepted
as a file too, so a run can be repeated from its own record.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..model import PRESETS, ModelConfig

RESOLVED_FORMAT = "kernelmix.train/1"


@dataclass
class TrainConfig:
    """Everything that defines a training run (plain data; saved, resolved, with every run).

    Batch arithmetic: every optimizer step sees ``batch_size × grad_accum × world_size`` sequences
    of ``seq_len`` tokens (the *global batch*); ``batch_size`` is per process and per micro-step.
    The data of a step is the same for every split of the global batch into processes and
    micro-steps with the same product ``grad_accum × world_size`` (see :mod:`.loop`), so one process
    with ``grad_accum=2`` trains on exactly the data of two processes with ``grad_accum=1``.
    """

    # -- model: a preset and overrides of its ModelConfig fields ------------------------------
    preset: str = "small"
    model: dict[str, Any] = field(default_factory=dict)  # e.g. {"mixer": "cubit", "mixer_options": {...}}

    # -- data ---------------------------------------------------------------------------------
    corpus: str = "pystdlib"  # a built-in corpus name, a file, a directory or a glob
    tokenizer: str = "byte"  # "byte", "bpe:N" (trained on the training split) or a saved tokenizer's path
    seq_len: int = 256
    cross_documents: bool = True  # windows may span document boundaries (positions restart per document)
    val_fraction: float = 0.05  # share of documents held out for validation (split by document name)

    # -- budget and batch ---------------------------------------------------------------------
    batch_size: int = 16  # sequences per process per micro-step
    grad_accum: int = 1  # micro-steps per optimizer step
    steps: int = 1000  # optimizer steps
    tokens: int = 0  # a token budget; when > 0 it sets steps = ceil(tokens / tokens per step)

    # -- optimizer and schedule ---------------------------------------------------------------
    lr: float = 1e-3  # peak learning rate, reached after warmup_steps
    min_lr: float = 1e-4  # the cosine decay ends here at the last step
    warmup_steps: int = 100
    weight_decay: float = 0.1  # on the weights of linear layers only (see loop.param_groups)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping

    # -- numerics, hardware, reproducibility ---------------------------------------------------
    bf16: bool = False  # bfloat16 autocast (CPU and CUDA); weights and optimizer stay float32
    device: str = "auto"  # "auto" (cuda:LOCAL_RANK when available, else cpu), "cpu" or "cuda"
    fsdp: bool = False  # shard parameters, gradients and optimizer state over processes (FSDP2) instead of DDP
    seed: int = 0
    redraw_every: int = 0  # redraw random-feature projections every N steps (0: never)

    # -- evaluation, logging, checkpoints -----------------------------------------------------
    eval_every: int = 200  # evaluate every N steps (and at the first and last step); 0: only at the end
    eval_batches: int = 20  # validation batches per evaluation (of batch_size sequences); 0: the whole split
    log_every: int = 10
    checkpoint_every: int = 500  # 0: only at the end
    keep_checkpoints: int = 2  # the newest N checkpoints are kept; older ones are deleted
    out_dir: str = "runs/train"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, _check_type(f.name, f.type, getattr(self, f.name)))
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r} (choose from: {', '.join(PRESETS)})")
        for name in ("seq_len", "batch_size", "grad_accum", "steps", "log_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("tokens", "warmup_steps", "eval_every", "eval_batches", "checkpoint_every", "redraw_every", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.lr == 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must lie in [0, 1), got {list(self.betas)}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r} (choose from: auto, cpu, cuda)")
        # Build the model config now so a typo in model.* fails before any data is read.
        self.model_config()

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """The preset with the ``model`` overrides; ``vocab_size``: the tokenizer's, used unless
        ``model.vocab_size`` is set (which must then be at least the tokenizer's)."""
        overrides = dict(self.model)
        if vocab_size is not None:
            chosen = overrides.setdefault("vocab_size", vocab_size)
            if chosen < vocab_size:
                raise ValueError(
                    f"model.vocab_size={chosen} is smaller than the tokenizer's vocabulary ({vocab_size} tokens); "
                    "drop the model.vocab_size override (it follows the tokenizer) or raise it"
                )
        try:
            config = ModelConfig.preset(self.preset, **overrides)
        except TypeError as error:  # a value of the wrong kind inside ModelConfig
            raise ValueError(f"invalid model override {self.model}: {error}") from error
        except ValueError as error:
            raise ValueError(f"{error} (in the model.* settings)") from error
        if self.seq_len > config.max_seq_len:
            raise ValueError(
                f"seq_len {self.seq_len} exceeds the model's max_seq_len {config.max_seq_len} (preset {self.preset!r}); "
                f"lower seq_len or set model.max_seq_len={self.seq_len}"
            )
        return config

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["betas"] = list(self.betas)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        """Build from a mapping; unknown keys are an error that lists the valid ones. A run's
        resolved ``config.json`` (with ``format``/``train``/``model`` sections) is accepted too."""
        if not isinstance(data, dict):
            raise ValueError(f"a training config must be a mapping of settings, got {type(data).__name__}")
        if data.get("format") == RESOLVED_FORMAT:
            data = data["train"]
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(
                f"unknown training setting(s) {unknown}; valid settings: {', '.join(names)} "
                f"(model settings go under model., e.g. model.mixer=cubit)"
            )
        return cls(**data)


# ---------------------------------------------------------------------------------------------
# Type checks: values from files and the command line arrive as JSON-ish data


def _check_type(name: str, annotation: str, value: Any) -> Any:
    def fail(expected: str) -> ValueError:
        return ValueError(f"{name} must be {expected}, got {value!r}")

    if annotation == "str":
        if not isinstance(value, str):
            raise fail("a string")
    elif annotation == "bool":
        if not isinstance(value, bool):
            raise fail("true or false")
    elif annotation == "int":
        # 1e6 is a natural way to write a token budget: accept integral floats
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail("an integer")
    elif annotation == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail("a number")
        value = float(value)
    elif annotation == "tuple[float, float]":
        if (
            not isinstance(value, (list, tuple))
            or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value)
        ):
            raise fail(f"two numbers, e.g. {name}=[0.9,0.95]")
        value = (float(value[0]), float(value[1]))
    elif annotation == "dict[str, Any]":
        if not isinstance(value, dict):
            raise fail("a mapping of settings (e.g. model.mixer=cubit)")
    else:  # pragma: no cover - every field's annotation is handled above
        raise TypeError(f"no type check for {name}: {annotation}")
    return value


# ---------------------------------------------------------------------------------------------
# Files and overrides


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a ``.toml``, ``.yaml``/``.yml`` or ``.json`` file (parsed, never executed)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    text = path.read_text(encoding="utf-8")
    try:
        if suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                try:
                    import tomli as tomllib  # type: ignore[no-redef]
                except ImportError:
                    raise ValueError("reading TOML on Python 3.10 needs tomli: pip install tomli (or use JSON)") from None
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ValueError("reading YAML needs PyYAML: pip install pyyaml (or use a .toml or .json file)") from None
            data = yaml.safe_load(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ValueError(f"config file {str(path)!r}: unknown format {suffix!r} (use .toml, .yaml, .yml or .json)")
    except ValueError:
        raise
    except Exception as error:  # the parsers' own error types (TOMLDecodeError, YAMLError, ...)
        raise ValueError(f"cannot parse config file {str(path)!r}: {error}") from error
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of settings, got {type(data).__name__}")
    if data.get("format") == RESOLVED_FORMAT:
        data = data["train"]
    return data


def parse_value(text: str) -> Any:
    """A ``--set`` value: JSON when it parses (numbers, ``[0.9, 0.95]``, ``{"lrr": false}``,
    ``"quoted"``), true/false/null in any case, otherwise the plain string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "none"):
        return None
    return text


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply ``key=value`` to ``data`` in place; ``model.a.b=v`` sets nested model settings."""
    key, sep, text = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"override {assignment!r} is not key=value (e.g. lr=3e-4 or model.mixer=cubit)")
    parts = key.split(".")
    if any(not part for part in parts):
        raise ValueError(f"override key {key!r} has an empty part")
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    if parts[0] not in names:
        raise ValueError(
            f"unknown training setting {parts[0]!r} in {assignment!r}; valid settings: {', '.join(names)} "
            f"(model settings go under model., e.g. model.mixer=cubit)"
        )
    if len(parts) > 1 and parts[0] != "model":
        raise ValueError(f"{parts[0]!r} has no sub-settings; write {parts[0]}=VALUE")
    target = data
    for part in parts[:-1]:
        child = target.get(part)
        if not isinstance(child, dict):
            child = target[part] = {}
        target = child
    target[parts[-1]] = parse_value(text)


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``update`` over ``base``; nested mappings (the model table) are merged key by key."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def build_config(
    config_file: str | Path | None = None,
    overrides: Iterable[str] = (),
    *,
    base: dict[str, Any] | None = None,
) -> TrainConfig:
    """Defaults ← ``base`` (e.g. the config of the run being resumed) ← the file ← the overrides."""
    data = dict(base or {})
    if config_file is not None:
        data = merge(data, read_config_file(config_file))
    for assignment in overrides:
        apply_override(data, assignment)
    return TrainConfig.from_dict(data)


def run_config(
    config_file: str | Path | None = None,
    overrides: Iterable[str] = (),
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
) -> TrainConfig:
    """The config ``kernelmix train`` runs: defaults ← (with ``resume``) the settings saved in the
    run's newest checkpoint ← the file ← the overrides ← ``out_dir``. So ``--resume --out DIR``
    alone continues a run as it was configured, and ``--set steps=N`` extends it."""
    update: dict[str, Any] = read_config_file(config_file) if config_file is not None else {}
    for assignment in overrides:
        apply_override(update, assignment)
    if out_dir is not None:
        update["out_dir"] = str(out_dir)
    base: dict[str, Any] = {}
    if resume:
        from .checkpoint import latest_checkpoint

        latest = latest_checkpoint(update.get("out_dir", TrainConfig.out_dir))
        try:  # unreadable: train() verifies the checkpoint and says what is wrong with it
            saved = json.loads((latest / "config.json").read_text(encoding="utf-8")) if latest else {}
            base = saved["train"] if saved.get("format") == RESOLVED_FORMAT else {}
        except (OSError, ValueError, KeyError, AttributeError):
            base = {}
    return TrainConfig.from_dict(merge(base, update))


__all__ = ["RESOLVED_FORMAT", "TrainConfig", "apply_override", "build_config", "parse_value", "read_config_file", "run_config"]
