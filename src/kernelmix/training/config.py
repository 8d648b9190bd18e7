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

This module imports no torch (nor the model code: :mod:`kernelmix.model_config`), so that
``kernelmix train`` builds its options and refuses a mistyped setting without it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Iterable

from ..config import Choice, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, check
from ..errors import KernelmixError
from ..model_config import ModelConfig
from ..presets import PRESETS

RESOLVED_FORMAT = "kernelmix.train/1"
#: the values of ``activation_checkpointing`` (:class:`~kernelmix.training.TrainConfig` and :func:`parallelize`)
ACTIVATION_CHECKPOINTING = ("none", "full", "selective", "mixers")
Beta = Annotated[float, Field(ge=0, lt=1)]


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
    preset: Annotated[str, Choice(PRESETS, "preset")] = "small"
    model: Annotated[dict[str, Any], Field(
        examples=["model.mixer=cubit"],
        description='ModelConfig overrides, e.g. {"mixer": "cubit", "mixer_options": {...}}',
    )] = field(default_factory=dict)

    # -- data ---------------------------------------------------------------------------------
    corpus: Annotated[str, Field(description="a built-in corpus name, a file, a directory or a glob")] = "pystdlib"
    tokenizer: Annotated[str, Field(
        description='"byte", "bpe:N" (trained on the training split) or a saved tokenizer\'s path')] = "byte"
    seq_len: Annotated[PositiveInt, Field(description="tokens per training window")] = 256
    cross_documents: Annotated[bool, Field(
        description="windows may span document boundaries (positions restart per document)")] = True
    val_fraction: Annotated[float, Field(
        ge=0, lt=1, description="share of documents held out for validation (split by document name)")] = 0.05

    # -- budget and batch ---------------------------------------------------------------------
    batch_size: Annotated[PositiveInt, Field(description="sequences per process per micro-step")] = 16
    grad_accum: Annotated[PositiveInt, Field(description="micro-steps per optimizer step")] = 1
    steps: Annotated[PositiveInt, Field(description="optimizer steps")] = 1000
    tokens: Annotated[NonNegativeInt, Field(
        description="a token budget; when > 0 it sets steps = ceil(tokens / tokens per step)")] = 0

    # -- optimizer and schedule ---------------------------------------------------------------
    lr: Annotated[PositiveFloat, Field(description="peak learning rate, reached after warmup_steps")] = 1e-3
    min_lr: Annotated[NonNegativeFloat, Field(description="the cosine decay ends here at the last step")] = 1e-4
    warmup_steps: NonNegativeInt = 100
    weight_decay: Annotated[NonNegativeFloat, Field(
        description="on the weights of linear layers only (see training.schedule.param_groups)")] = 0.1
    betas: Annotated[tuple[Beta, Beta], Field(examples=["betas=[0.9,0.95]"], description="AdamW's betas")] = (0.9, 0.95)
    grad_clip: Annotated[NonNegativeFloat, Field(description="max global gradient norm; 0 disables clipping")] = 1.0

    # -- numerics, hardware, reproducibility ---------------------------------------------------
    bf16: Annotated[bool, Field(
        description="bfloat16 autocast (CPU and CUDA); weights and optimizer stay float32")] = False
    device: Annotated[str, Choice(("auto", "cpu", "cuda"), "device"), Field(
        description="auto (cuda:LOCAL_RANK when available, else cpu), cpu or cuda")] = "auto"
    fsdp: Annotated[bool, Field(
        description="shard parameters, gradients and optimizer state over processes (FSDP2) instead of DDP")] = False
    activation_checkpointing: Annotated[str, Choice(ACTIVATION_CHECKPOINTING, "activation_checkpointing"), Field(
        description="recompute in the backward instead of storing: none, full (every block), selective (every "
                    "activation_checkpointing_every-th block) or mixers (each block's mixer only); same numbers, "
                    "less memory")] = "none"
    activation_checkpointing_every: Annotated[PositiveInt, Field(
        description="with activation_checkpointing=selective: every k-th block is recomputed")] = 2
    compile: Annotated[bool, Field(
        description="torch.compile each block (inductor; graph breaks where an op reads its values); the first "
                    "steps compile, later ones reuse it")] = False
    seed: NonNegativeInt = 0
    redraw_every: Annotated[NonNegativeInt, Field(
        description="redraw random-feature projections every N steps (0: never)")] = 0
    max_bad_steps: Annotated[PositiveInt, Field(
        description="updates in a row with a non-finite loss or gradient (each one skipped) that stop the run")] = 5

    # -- evaluation, logging, checkpoints -----------------------------------------------------
    eval_every: Annotated[NonNegativeInt, Field(
        description="evaluate every N steps (and at the first and last step); 0: only at the end")] = 200
    eval_batches: Annotated[NonNegativeInt, Field(
        description="validation batches per evaluation (of batch_size sequences); 0: the whole split")] = 20
    log_every: PositiveInt = 10
    checkpoint_every: Annotated[NonNegativeInt, Field(description="0: only at the end")] = 500
    keep_checkpoints: Annotated[PositiveInt, Field(
        description="the newest N checkpoints are kept; older ones are deleted")] = 2
    out_dir: Annotated[str, Field(description="the run directory")] = "runs/train"

    def __post_init__(self) -> None:
        check(self)
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr must be at most lr, got lr={self.lr}, min_lr={self.min_lr}")
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
                f"seq_len {self.seq_len} exceeds the model's max_seq_len {config.max_seq_len} (preset "
                f"{self.preset!r}); lower seq_len or set model.max_seq_len={self.seq_len}"
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
            data = resolved_train_section(data, "a resolved run config")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(
                f"unknown training setting(s) {unknown}; valid settings: {', '.join(names)} "
                f"(model settings go under model., e.g. model.mixer=cubit)"
            )
        return cls(**data)


# ---------------------------------------------------------------------------------------------
# Files and overrides


def resolved_train_section(data: dict[str, Any], where: str) -> dict[str, Any]:
    """The ``train`` mapping of a run's resolved ``config.json``; a missing or non-mapping section is a
    KernelmixError that names ``where`` (the file is damaged)."""
    section = data.get("train")
    if not isinstance(section, dict):
        got = "nothing" if section is None else type(section).__name__
        raise KernelmixError(f"{where}: its 'train' section must be a mapping of settings, got {got}: the file is "
                             "damaged; use the run's original settings")
    return section


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a ``.toml``, ``.yaml``/``.yml`` or ``.json`` file (parsed, never executed).

    Args:
        path: the file; its suffix chooses the parser (TOML needs Python ≥ 3.11 or tomli, YAML needs PyYAML).

    Returns:
        The settings mapping (``{}`` for an empty file); of a run's resolved ``config.json``, its ``train``
        section."""
    path = Path(path)
    if path.is_dir():
        raise KernelmixError(f"config file {str(path)!r} is a directory: pass the config file inside it")
    if not path.is_file():
        raise KernelmixError(f"config file {str(path)!r} does not exist: check the path")
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise KernelmixError(f"config file {str(path)!r} is not UTF-8 text ({error.reason} at byte {error.start}): "
                             "save it as UTF-8") from None
    try:
        if suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                try:
                    import tomli as tomllib  # type: ignore[no-redef]
                except ImportError:
                    raise ValueError(
                        "reading TOML on Python 3.10 needs tomli: pip install tomli (or use JSON)") from None
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ValueError(
                    "reading YAML needs PyYAML: pip install pyyaml (or use a .toml or .json file)") from None
            data = yaml.safe_load(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ValueError(f"config file {str(path)!r}: unknown format {suffix!r} (use .toml, .yaml, .yml or .json)")
    except ValueError as error:
        if str(path) in str(error):  # ours, already naming the file
            raise
        # TOMLDecodeError and JSONDecodeError are ValueErrors: say which file they are about
        raise ValueError(f"cannot parse config file {str(path)!r}: {error}") from error
    except Exception as error:  # the other parsers' own error types (YAMLError, ...)
        raise ValueError(f"cannot parse config file {str(path)!r}: {error}") from error
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of settings, got {type(data).__name__}")
    if data.get("format") == RESOLVED_FORMAT:
        data = resolved_train_section(data, f"config file {str(path)!r} (a run's resolved config)")
    return data


def parse_value(text: str) -> Any:
    """A ``--set`` value: JSON when it parses (numbers, ``[0.9, 0.95]``, ``{"lrr": false}``,
    ``"quoted"``), true/false/null in any case, otherwise the plain string.

    Args:
        text: the text after ``=``.

    Returns:
        The value: what JSON gives, a bool, None (also for ``none``), or ``text`` unchanged."""
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
    """Apply ``key=value`` to ``data`` in place; ``model.a.b=v`` sets nested model settings.

    Args:
        data: a mapping of settings (as :meth:`TrainConfig.from_dict` takes).
        assignment: ``key=value``: the key a :class:`TrainConfig` field, or a dotted path under ``model``;
            the value read by :func:`parse_value`.

    Returns:
        None; ``data`` is changed in place (a malformed assignment or an unknown key is a ValueError)."""
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
    """Defaults ← ``base`` (e.g. the config of the run being resumed) ← the file ← the overrides.

    Args:
        config_file: a TOML/YAML/JSON file of settings (:func:`read_config_file`), or None.
        overrides: ``key=value`` assignments (:func:`apply_override`), applied in order.
        base: settings beneath the file's (the model table merged key by key); None: none.

    Returns:
        The :class:`TrainConfig`, checked."""
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
    alone continues a run as it was configured, and ``--set steps=N --reschedule`` extends it.

    Args:
        config_file: a TOML/YAML/JSON file of settings (:func:`read_config_file`), or None.
        overrides: ``key=value`` assignments (:func:`apply_override`), applied in order.
        out_dir: the run directory, where ``resume`` looks for checkpoints (None: the file's or the
            overrides' ``out_dir``, else :class:`TrainConfig`'s default).
        resume: start from the settings of the newest checkpoint in the run directory whose
            ``config.json`` reads.

    Returns:
        The :class:`TrainConfig`, checked."""
    update: dict[str, Any] = read_config_file(config_file) if config_file is not None else {}
    for assignment in overrides:
        apply_override(update, assignment)
    if out_dir is not None:
        update["out_dir"] = str(out_dir)
    base: dict[str, Any] = {}
    if resume:
        from .checkpoint import list_checkpoints

        # the newest checkpoint whose record reads: train() falls back past a damaged newest one
        # too, and verifies the checkpoint it resumes from (saying what is wrong with the others)
        for _, path in reversed(list_checkpoints(update.get("out_dir", TrainConfig.out_dir))):
            try:
                saved = json.loads((path / "config.json").read_text(encoding="utf-8"))
                base = saved["train"] if saved.get("format") == RESOLVED_FORMAT else {}
            except (OSError, ValueError, KeyError, AttributeError):
                continue
            break
    return TrainConfig.from_dict(merge(base, update))


__all__ = ["ACTIVATION_CHECKPOINTING", "RESOLVED_FORMAT", "TrainConfig", "apply_override", "build_config",
           "parse_value", "read_config_file", "run_config"]
