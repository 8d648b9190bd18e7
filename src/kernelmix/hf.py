"""Hugging Face adapter: a kernelmix :class:`~kernelmix.model.CausalLM` as a transformers model.

Optional (``pip install "kernelmix[hf]"``, transformers ≥ 5.24). Our config and model stay ours;
this module only translates::

    from kernelmix.hf import KernelMixConfig, KernelMixForCausalLM
    config = KernelMixConfig.from_model_config(ModelConfig.preset("tiny", mixer="cubit"))
    model = KernelMixForCausalLM(config)          # model.model is the kernelmix CausalLM
    model.save_pretrained(path)                   # config.json + model.safetensors
    model = AutoModelForCausalLM.from_pretrained(path)
    tokens = model.generate(input_ids, max_new_tokens=20, do_sample=False)

* :class:`KernelMixConfig` (``model_type = "kernelmix"``) holds every :class:`ModelConfig` field
  under the same name (plus HF's aliases ``num_hidden_layers``, ``num_attention_heads``,
  ``num_key_value_heads``, ``max_position_embeddings``, ``tie_word_embeddings``) and converts
  both ways: :meth:`KernelMixConfig.from_model_config` / :meth:`KernelMixConfig.to_model_config`.
* :class:`KernelMixForCausalLM` owns a ``CausalLM`` (``.model``) and translates arguments and
  outputs. The state dict is the CausalLM's under ``model.``: the random-feature projections
  (``projection``) and DARKFormer's ``query_fold`` are persistent buffers and its ``transform``
  a parameter, so all of them travel in ``model.safetensors``. A tied LM head is stored once
  (``model.embed.weight``) and re-tied on load.
* Generation keeps the model's own :class:`~kernelmix.model.ModelCache` under HF's cache name
  ``cache`` (``outputs.cache`` → next step's ``cache=``); no ``DynamicCache`` is created. Once
  a cache exists only the tokens it has not seen are fed; positions and document boundaries come
  from ``attention_mask`` (``[B, past + T]``, left padding) and the cache. Greedy and sampling
  are supported; beam search and assisted decoding are refused (the cache cannot be reordered
  or rolled back).
* ``save_pretrained`` writes ``kernelmix.checksums.json`` beside the weights (size and SHA-256 of
  each weights file); ``from_pretrained`` of a local directory verifies it before loading, so a
  weights file changed or damaged after saving is an error naming it, not wrong weights. A save
  without the file (older kernelmix, or a download from the Hub, which does not carry it) loads
  as before.
* Loading is strict: a checkpoint with missing or unexpected tensors (e.g. saved with other
  mixers) or tensors of other shapes (e.g. ``vocab_size=`` given on loading) is an error, never a
  silently re-initialised layer; a different vocabulary is ``model.resize_token_embeddings(n)``
  after loading.
* ``generate`` refuses, before the first token, what transformers lets through: a right-padded
  ``attention_mask``, an empty prompt, special token ids outside the vocabulary, length options
  (``max_new_tokens``, ...) that are not ints or leave nothing to generate, and a run past
  ``max_seq_len`` (a prompt that alone fills it is told how to shorten it).

Registration: ``import kernelmix`` registers these classes with ``AutoConfig`` and
``AutoModelForCausalLM`` as soon as transformers is imported (see ``kernelmix/__init__.py``);
importing this module registers them too.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import numbers
import os
import threading
import typing
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

try:
    import transformers
except ImportError as error:
    raise ImportError('kernelmix.hf needs transformers >= 5.24: pip install "kernelmix[hf]"') from error
if tuple(int(part) for part in transformers.__version__.split(".")[:2] if part.isdigit()) < (5, 24):
    raise ImportError(
        f"kernelmix.hf needs transformers >= 5.24, found {transformers.__version__}; "
        'upgrade with: pip install "kernelmix[hf]"'
    )

from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.generation import GenerationMode
from transformers.modeling_outputs import CausalLMOutputWithPast

from .errors import KernelmixError
from .generate import check_left_padded
from .model import CausalLM, ModelCache, ModelConfig
from .output import file_sha256, write_json_atomic

_MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))


def _model_config_fields() -> type:
    """A dataclass with every :class:`ModelConfig` field (name, type, default) and nothing else.

    transformers ≥ 5 turns each ``PreTrainedConfig`` subclass into a keyword-only dataclass whose
    fields are its annotated attributes and those of its dataclass bases; inheriting from this one
    gives :class:`KernelMixConfig` the model's fields without spelling them again, so a new
    ``ModelConfig`` field needs no edit here."""
    hints = typing.get_type_hints(ModelConfig)
    fields = []
    for f in dataclasses.fields(ModelConfig):
        if f.default_factory is not dataclasses.MISSING:
            default = dataclasses.field(default_factory=f.default_factory)
        else:
            default = dataclasses.field(default=f.default)
        fields.append((f.name, hints[f.name], default))
    return dataclasses.make_dataclass("ModelConfigFields", fields, kw_only=True, repr=False, eq=False)


class KernelMixConfig(PreTrainedConfig, _model_config_fields()):
    """A :class:`~kernelmix.model.ModelConfig` as a transformers config (same fields, same
    defaults, validated by ModelConfig itself; ``None`` defaults are resolved on construction).
    Extra keyword arguments are HF's (``eos_token_id``, ``pad_token_id``, ...)."""

    model_type = "kernelmix"
    attribute_map = {
        "num_hidden_layers": "num_layers",
        "num_attention_heads": "num_heads",
        "num_key_value_heads": "num_kv_heads",
        "max_position_embeddings": "max_seq_len",
        "tie_word_embeddings": "tie_embeddings",
    }

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        # ModelConfig validates (its errors name the field and the fix) and fills in the defaults
        for name, value in self.to_model_config().to_dict().items():
            setattr(self, name, value)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any):
        # transformers only warns when a config.json of another model type is loaded with this class
        model_type = config_dict.get("model_type", cls.model_type)
        if model_type != cls.model_type:
            raise KernelmixError(
                f"this config has model_type {model_type!r}, not {cls.model_type!r}: it describes another kind of "
                "model; load it with its own class (AutoConfig / AutoModelForCausalLM choose it from model_type)"
            )
        result = super().from_dict(config_dict, **kwargs)
        config = result[0] if isinstance(result, tuple) else result  # (config, unused) with return_unused_kwargs
        # transformers sets keyword overrides (from_pretrained(path, mixer_options=...)) after __post_init__,
        # so they are validated here, not first when the model is built
        for name, value in config.to_model_config().to_dict().items():
            setattr(config, name, value)
        return result

    @classmethod
    def from_model_config(cls, config: ModelConfig, **kwargs: Any) -> "KernelMixConfig":
        """The HF config of a kernelmix ``ModelConfig``; ``kwargs`` are HF extras (``eos_token_id``, ...)."""
        if not isinstance(config, ModelConfig):
            raise KernelmixError(f"config must be a kernelmix ModelConfig, got {type(config).__name__}")
        return cls(**copy.deepcopy(config.to_dict()), **kwargs)

    def to_model_config(self) -> ModelConfig:
        """The kernelmix ``ModelConfig`` these fields describe (a copy: changing it changes nothing here)."""
        return ModelConfig.from_dict(copy.deepcopy({name: getattr(self, name) for name in _MODEL_FIELDS}))


class KernelMixForCausalLM(PreTrainedModel, GenerationMixin):
    """A kernelmix :class:`~kernelmix.model.CausalLM` (``self.model``) behind the transformers API.

    ``forward(input_ids, attention_mask, position_ids, cache, labels, use_cache, return_dict)``
    returns a ``CausalLMOutputWithPast`` (``logits``, ``loss``, ``cache``: a ``ModelCache``).
    ``use_cache`` defaults to ``not self.training``. ``inputs_embeds`` and attention/hidden-state
    outputs are not supported."""

    config_class = KernelMixConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}  # applies when tie_word_embeddings
    _is_stateful = True  # no rollback: assisted decoding is refused clearly
    _supported_generation_modes = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)

    def __init__(self, config: KernelMixConfig, **unknown: Any) -> None:
        if unknown:  # from_pretrained hands on what is neither a config field nor one of its own options
            fields = sorted(set(_MODEL_FIELDS) | set(KernelMixConfig.attribute_map))
            raise KernelmixError(
                f"unknown argument(s) {sorted(unknown)}: not a KernelMixConfig field nor a from_pretrained option; "
                f"the config fields are: {', '.join(fields)}"
            )
        if not isinstance(config, KernelMixConfig):
            raise KernelmixError(
                f"config must be a KernelMixConfig, got {type(config).__name__}; "
                "convert a ModelConfig with KernelMixConfig.from_model_config(config)"
            )
        super().__init__(config)
        self.model = CausalLM(config.to_model_config())
        self.post_init()

    @classmethod
    def from_model(cls, model: CausalLM, **config_kwargs: Any) -> "KernelMixForCausalLM":
        """Wrap an existing kernelmix ``CausalLM`` (shared, not copied), e.g. to save a trained model."""
        if not isinstance(model, CausalLM):
            raise KernelmixError(f"model must be a kernelmix CausalLM, got {type(model).__name__}")
        config = KernelMixConfig.from_model_config(model.config, **config_kwargs)
        with torch.device("meta"):  # a placeholder CausalLM: no memory, no draw from the RNG
            wrapper = cls(config)
        wrapper.model = model
        return wrapper

    def _init_weights(self, module: torch.nn.Module) -> None:
        # CausalLM initialises itself (GPT-2 residual scaling, mixer-specific inits, random
        # projections); HF's generic re-initialisation would undo that. Missing tensors on load
        # are an error (from_pretrained below), so nothing is ever left to initialise here.
        pass

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.model.embed

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.model.lm_head

    def set_input_embeddings(self, value: torch.nn.Embedding) -> None:
        # what resize_token_embeddings calls; the CausalLM's own config checks token ids against its vocab_size
        self.model.embed = value
        self.model.config.vocab_size = value.num_embeddings

    def set_output_embeddings(self, value: torch.nn.Linear) -> None:
        self.model.lm_head = value

    def save_pretrained(self, save_directory: str | os.PathLike, is_main_process: bool = True, **kwargs: Any):
        """``PreTrainedModel.save_pretrained``, then ``kernelmix.checksums.json`` beside the weights
        (what :meth:`from_pretrained` verifies). With ``push_to_hub=True`` the checksum file stays local."""
        result = super().save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            write_checksums(Path(save_directory))
        return result

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any):
        """``PreTrainedModel.from_pretrained``, strict: a checkpoint whose tensors do not match this
        config (missing or unexpected keys, or other shapes, e.g. from ``vocab_size=`` given on
        loading) raises :class:`~kernelmix.errors.KernelmixError` instead of loading a partly random
        model. ``ignore_mismatched_sizes=True`` is refused: the tensors it skips would stay
        uninitialised (a CausalLM initialises itself as a whole, not tensor by tensor)."""
        want_info = kwargs.pop("output_loading_info", False)
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        if kwargs.pop("ignore_mismatched_sizes", False):
            raise KernelmixError(
                "ignore_mismatched_sizes=True is not supported for kernelmix models: the tensors whose shapes differ "
                "would be left uninitialised. Load the checkpoint as saved, then change it — for another vocabulary "
                "size, model.resize_token_embeddings(n)"
            )
        if isinstance(source, (str, os.PathLike)) and Path(source, kwargs.get("subfolder") or "").is_dir():
            verify_checksums(Path(source, kwargs.get("subfolder") or ""))
        reports = _HeldLoadReports()
        try:
            with reports:
                # shapes that differ are collected (not raised on) so that the error below can name them and the fix
                model, info = super().from_pretrained(
                    *args, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
                )
        except SafetensorError as error:  # its message names neither the file nor the likely cause
            raise KernelmixError(
                f"cannot read the weights in {str(source)!r} ({error}): the .safetensors file is truncated or "
                "corrupt; save or copy the model again"
            ) from error
        except BaseException:
            reports.release()  # transformers' own error points at its report
            raise
        error = _load_error(str(source), model, info, kwargs)
        if error is not None:
            raise error  # alone: the report held back lists the same keys, without the fix
        reports.release()
        return (model, info) if want_info else model

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> torch.nn.Embedding:
        """``PreTrainedModel.resize_token_embeddings``: the embedding (and an untied LM head) get
        ``new_num_tokens`` rows, the trained rows kept; the CausalLM's config follows."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        self.model.config.vocab_size = self.config.vocab_size = embeddings.num_embeddings
        return embeddings

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: ModelCache | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
    ) -> CausalLMOutputWithPast | tuple:
        if use_cache is None:
            use_cache = not self.training
        out = self.model(
            input_ids,
            labels=labels,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
        )
        output = CausalLMOutputWithPast(loss=out.loss, logits=out.logits, cache=out.cache)
        if return_dict is False or (return_dict is None and not self.config.return_dict):
            return output.to_tuple()
        return output

    def generate(self, *args: Any, **kwargs: Any):
        """``GenerationMixin.generate`` (see its documentation); generation starts from the prompt,
        a cache cannot be passed in (transformers would treat it as one of its ``Cache`` objects)."""
        if any(kwargs.get(name) is not None for name in ("cache", "past_key_values", "cache_params")):
            raise KernelmixError(
                "generate() does not take a cache for a kernelmix model (a ModelCache is not a transformers "
                "Cache); pass the whole token sequence, or continue with model(new_ids, cache=...) yourself"
            )
        self._check_generate_inputs(args[0] if args else kwargs.get("inputs", kwargs.get("input_ids")), kwargs)
        return super().generate(*args, **kwargs)

    def _check_generate_inputs(self, input_ids: Any, kwargs: dict[str, Any]) -> None:
        """What transformers lets through: an empty prompt (an IndexError deep inside), a right-padded
        mask (a warning, then tokens generated after the padding) and special token ids outside the
        vocabulary (fed back to the model once a row has ended)."""
        if isinstance(input_ids, Tensor) and input_ids.dim() == 2 and input_ids.shape[1] == 0:
            raise KernelmixError(
                f"input_ids holds no prompt token (shape {list(input_ids.shape)}); generation continues a prompt, so "
                "start each row with at least one token, e.g. the tokenizer's BOS token"
            )
        mask = kwargs.get("attention_mask")
        if isinstance(mask, Tensor) and mask.dim() == 2 and mask.shape[1] > 0:
            check_left_padded(mask.bool())
        vocab_size = self.config.vocab_size
        generation_config = kwargs.get("generation_config") or self.generation_config
        _check_lengths(kwargs, generation_config)
        for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
            value = kwargs.get(name, getattr(generation_config, name, None))
            values = value.tolist() if isinstance(value, Tensor) else value
            for token in values if isinstance(values, (list, tuple)) else [values]:
                if token is not None and not 0 <= int(token) < vocab_size:
                    raise KernelmixError(
                        f"{name}={value!r} is not a token of this model (ids lie in [0, {vocab_size}), vocab_size); "
                        f"pass the {name} of the tokenizer this model was trained with"
                    )

    def _prepare_cache_for_generation(self, generation_config: Any, model_kwargs: dict[str, Any], *args: Any,
                                      **kwargs: Any) -> Any:
        # the first hook of generate() that sees both the final max_length and the prompt's positions
        # (from its attention mask): a run past max_seq_len is refused here, before any token, not
        # by the model at the step that gets there
        position_ids = model_kwargs.get("position_ids")
        if isinstance(position_ids, Tensor) and position_ids.numel():
            new_tokens = generation_config.max_length - position_ids.shape[-1]
            prompt = int(position_ids.max()) + 1
            limit = self.config.max_seq_len
            if prompt >= limit:  # no max_new_tokens fits: HF refuses 0
                keep = limit - 1
                raise KernelmixError(
                    f"a prompt of {prompt} tokens leaves no room to generate: the model's max_seq_len = {limit} "
                    f"positions hold at most {keep} prompt tokens plus one new token; shorten the prompt to at most "
                    f"{keep} tokens (e.g. its last ones: input_ids[:, -{keep}:], and attention_mask[:, -{keep}:] "
                    "with it), or use a model with a larger max_seq_len"
                )
            if prompt + new_tokens > limit:
                raise KernelmixError(
                    f"a prompt of {prompt} tokens plus {new_tokens} new tokens is {prompt + new_tokens} positions, "
                    f"beyond the model's max_seq_len = {limit}; ask for at most max_new_tokens={limit - prompt} "
                    "or shorten the prompt"
                )
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

    def prepare_inputs_for_generation(
        self,
        input_ids: Tensor,
        cache: ModelCache | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        use_cache: bool = True,
        next_sequence_length: int | None = None,
        is_first_iteration: bool | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Inputs of one generation step: with a cache only the tokens it has not seen (HF keeps
        the whole sequence in ``input_ids`` and the whole ``[B, past + T]`` attention mask, which
        the model accepts). HF derives ``position_ids`` from the mask exactly as the model does;
        on the first step of an unpadded batch they are dropped, so the model takes its plain
        causal path (bitwise equal to :func:`kernelmix.generate.generate`)."""
        if cache is not None:
            input_ids = input_ids[:, cache.length :]
        elif next_sequence_length is not None:
            input_ids = input_ids[:, -next_sequence_length:]
        length = input_ids.shape[1]
        if position_ids is not None:
            position_ids = position_ids[:, -length:]
            if cache is None and attention_mask is None:
                default = torch.arange(length, device=position_ids.device).expand_as(position_ids)
                if torch.equal(position_ids, default):
                    position_ids = None
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "cache": cache,
            "use_cache": use_cache,
            **kwargs,
        }
        return {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in inputs.items() if v is not None}

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model carries its own ModelCache (HF's escape route for mamba-like models)


#: the checksum file save_pretrained writes beside the weights, and the weights files it covers
CHECKSUMS_NAME = "kernelmix.checksums.json"
CHECKSUMS_FORMAT = 1
_WEIGHTS_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")


def write_checksums(directory: Path) -> Path:
    """Write ``directory/kernelmix.checksums.json``: size and SHA-256 of every weights file there."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name.endswith(_WEIGHTS_SUFFIXES))
    record = {"format": CHECKSUMS_FORMAT,
              "files": {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in files}}
    return write_json_atomic(directory / CHECKSUMS_NAME, record, sort_keys=True)


def verify_checksums(directory: Path) -> None:
    """Check the weights files of a save against its checksum file (nothing to check without one: a
    save from before checksums); a KernelmixError names the first file that differs and the fix."""
    path = directory / CHECKSUMS_NAME
    if not path.is_file():
        return
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        files = dict(record["files"])
        if record.get("format") != CHECKSUMS_FORMAT:
            raise ValueError(f"format {record.get('format')!r}, this kernelmix reads format {CHECKSUMS_FORMAT}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise KernelmixError(
            f"cannot read {path} ({error}); save or copy the model again, or delete {CHECKSUMS_NAME} to load the "
            "weights unchecked") from None
    for name, expected in sorted(files.items()):
        weights = directory / name
        if not weights.is_file():  # a file the save no longer uses; one it needs is transformers' error
            continue
        size = weights.stat().st_size
        if size != expected.get("bytes") or file_sha256(weights) != expected.get("sha256"):
            change = (f"{size} bytes, saved with {expected.get('bytes')}" if size != expected.get("bytes")
                      else "same size, other bytes")
            raise KernelmixError(
                f"{weights} does not match the checksum written when the model was saved ({change}): the file is "
                f"truncated or corrupt, so its weights would be wrong; save or copy the model again. (Weights changed "
                f"on purpose: save them with save_pretrained, which writes a new {CHECKSUMS_NAME}.)")


#: generate()'s length options: each an int, at least this (transformers compares them unchecked: a
#: string was a TypeError deep inside, a float was taken as it came)
_LENGTH_OPTIONS = {"max_new_tokens": 1, "max_length": 1, "min_new_tokens": 0, "min_length": 0}


def _check_lengths(kwargs: dict[str, Any], generation_config: Any) -> None:
    """``max_new_tokens`` and the other length options, given to ``generate`` or in its generation
    config: ints (not bools) at least their minimum, else a KernelmixError naming the value and the fix."""
    for name, least in _LENGTH_OPTIONS.items():
        value = kwargs[name] if name in kwargs else getattr(generation_config, name, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, numbers.Integral)):
            whole = (isinstance(value, str) and value.strip().isdigit()) or (
                isinstance(value, float) and value.is_integer())
            example = f"{name}={int(value)}" if whole else f"{name}=20"
            raise KernelmixError(
                f"{name} must be an int (a number of tokens), got {value!r} ({type(value).__name__}); pass an int, "
                f"e.g. {example}")
        if value < least:
            what = "at least one token to generate" if name == "max_new_tokens" else "a number of tokens"
            raise KernelmixError(f"{name} must be >= {least} ({what}), got {value}; pass e.g. {name}=20")


class _HeldLoadReports(logging.Filter):
    """Holds back the LOAD REPORT transformers logs in this thread during a load (a table of the
    missing, unexpected and mismatched tensors) while it is installed: where the load is our error,
    the error comes alone instead of after a table that says "Reinit" and no fix; :meth:`release`
    logs what was held, as it was, where it is not."""

    LOGGERS = ("transformers.modeling_utils", "transformers.utils.loading_report")

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread == self.thread and "LOAD REPORT" in record.getMessage():
            self.held.append(record)
            return False
        return True

    def __enter__(self) -> "_HeldLoadReports":
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)

    def release(self) -> None:
        held, self.held = self.held, []
        for record in held:
            logging.getLogger(record.name).handle(record)


def _load_error(source: str, model: "KernelMixForCausalLM", info: dict[str, Any],
                kwargs: dict[str, Any]) -> KernelmixError | None:
    """Why the checkpoint at ``source`` does not fit the model built for it (``info``: transformers'
    loading info), or None when it fits."""
    missing, unexpected = sorted(info.get("missing_keys", ())), sorted(info.get("unexpected_keys", ()))
    if missing or unexpected:
        return KernelmixError(
            f"checkpoint {source!r} does not match its config (mixers "
            f"{model.config.to_model_config().layer_mixers()}): missing tensors {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected tensors {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}; was config.json edited or the weights saved from "
            "another model?"
        )
    mismatched = sorted(info.get("mismatched_keys", ()))
    if not mismatched:
        return None
    return KernelmixError(_mismatch_message(source, mismatched, kwargs, _built_as_saved(source, model, kwargs)))


def _built_as_saved(source: str, model: "KernelMixForCausalLM", kwargs: dict[str, Any]) -> bool:
    """Whether ``model`` was built from the config.json saved at ``source`` as it is (AutoModel
    passes it as ``config=``): then that file, not the load's arguments, does not fit the weights."""
    path = Path(source, kwargs.get("subfolder") or "", "config.json")
    try:
        saved = KernelMixConfig.from_dict(json.loads(path.read_text(encoding="utf-8")))
        return saved.to_model_config() == model.config.to_model_config()
    except (OSError, ValueError, TypeError):  # not a local directory, or a config.json that does not parse
        return False


def _mismatch_message(source: str, mismatched: list[tuple[str, Any, Any]], kwargs: dict[str, Any],
                      as_saved: bool = False) -> str:
    """Why a checkpoint's tensors have other shapes than the model built for it, and the fix
    (``as_saved``: the model was built from the checkpoint's own config.json, unchanged)."""
    shown = ", ".join(f"{key} {list(saved)} there, {list(built)} here" for key, saved, built in mismatched[:4])
    shown += ", ..." if len(mismatched) > 4 else ""
    if as_saved:
        return (
            f"checkpoint {source!r} holds tensors of other shapes than its config.json builds ({shown}): config.json "
            "was edited or the weights come from another model; restore the config.json saved with these weights "
            "(or save the model again)"
        )
    vocab_keys = {"model.embed.weight", "model.lm_head.weight"}
    if all(key in vocab_keys and saved[1:] == built[1:] for key, saved, built in mismatched):
        _, saved, built = mismatched[0]
        return (
            f"checkpoint {source!r} was saved with vocab_size {saved[0]}, but this load asks for vocab_size {built[0]} "
            f"({mismatched[0][0]} is {list(saved)} there, {list(built)} here); load it as saved and resize the "
            f"embeddings afterwards, which keeps the trained rows: model = KernelMixForCausalLM.from_pretrained(path); "
            f"model.resize_token_embeddings({built[0]}) — or leave vocab_size out"
        )
    fields = set(_MODEL_FIELDS) | set(KernelMixConfig.attribute_map)
    overrides = [f"{name}={kwargs[name]!r}" for name in kwargs if name in fields]
    if kwargs.get("config") is not None:
        overrides.append("config=...")
    return (
        f"checkpoint {source!r} holds tensors of other shapes than the model built for this load ({shown}): the "
        "config was changed on loading"
        f"{' (' + ', '.join(overrides) + ')' if overrides else ''}; load the checkpoint with the config it was "
        "saved with (drop those arguments) and change the model afterwards"
    )


def register() -> None:
    """Register :class:`KernelMixConfig` / :class:`KernelMixForCausalLM` with ``AutoConfig`` and
    ``AutoModelForCausalLM`` (idempotent; done on import of this module)."""
    AutoConfig.register(KernelMixConfig.model_type, KernelMixConfig, exist_ok=True)
    AutoModelForCausalLM.register(KernelMixConfig, KernelMixForCausalLM, exist_ok=True)


register()

__all__ = ["KernelMixConfig", "KernelMixForCausalLM", "register"]
