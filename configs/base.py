"""Typed config machinery: dict/YAML -> dataclasses, dotted overrides, clear errors.

Every config section is a plain dataclass. This module turns nested dicts (from YAML) and
``--section.field value`` overrides into those dataclasses, checking each value's type against the
annotation, and names the offending field, the value and what is allowed when something is wrong.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """A config value is unknown, of the wrong type, or inconsistent with another value."""


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _choice_text(tp: Any) -> str:
    """How one member of a Union reads in an error: a Literal's values, true/false, null, or a type's name."""
    if get_origin(tp) is typing.Literal:
        return " | ".join(repr(v) for v in get_args(tp))
    return {bool: "true | false", type(None): "null"}.get(tp, _type_name(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against annotation ``tp``; return it (converted where lossless)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Union or origin is types.UnionType:
        for arg in get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                pass
        choices = [_choice_text(a) for a in get_args(tp)]
        raise ConfigError(f"{where}: value {value!r} is not allowed; choose one of {', '.join(choices)}")
    if origin is typing.Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{where}: value {value!r} is not allowed; choose one of {list(allowed)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item_tp, *_) = get_args(tp) or (Any,)
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise ConfigError(f"{where}: unsupported annotation {tp!r}")


def config_keys(cls: type) -> dict[str, str]:
    """YAML/CLI key -> field name of dataclass ``cls``. A key is its field's name unless the field's metadata gives
    another ``key``: a name Python cannot use for an attribute, such as ``checkpoint.async`` (field ``async_save``)."""
    return {f.metadata.get("key", f.name): f.name for f in dataclasses.fields(cls)}


# The names other trainers give our fields (Hugging Face TrainingArguments and model configs, Megatron's flags), which
# difflib alone does not lead to ours ('learning_rate' is 0.29 like 'lr'): a mistyped key is matched against them too.
KNOWN_AS = {
    "learning_rate": "lr", "batch_size": "micro_batch_size", "per_device_train_batch_size": "micro_batch_size",
    "gradient_accumulation_steps": "grad_accum_steps", "train_steps": "max_steps", "train_iters": "max_steps",
    "max_grad_norm": "grad_clip", "clip_grad": "grad_clip", "adam_beta1": "beta1", "adam_beta2": "beta2",
    "adam_epsilon": "eps", "warmup_iters": "warmup_steps", "lr_warmup_iters": "warmup_steps",
    "num_layers": "n_layers", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads", "num_query_groups": "n_kv_heads", "hidden_size": "d_model",
    "intermediate_size": "ffn_hidden", "ffn_hidden_size": "ffn_hidden", "max_position_embeddings": "max_seq_len",
    "seq_length": "seq_len", "tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
    "context_parallel_size": "cp", "expert_model_parallel_size": "ep", "num_experts": "n_experts",
}


def closest_key(name: str, keys) -> str | None:
    """The key of ``keys`` that a mistyped ``name`` most likely meant (difflib's closest at a ratio of 0.6 or more,
    also through KNOWN_AS); None when none is close."""
    candidates = {k: k for k in keys}
    candidates.update({alias: k for alias, k in KNOWN_AS.items() if k in candidates and alias not in candidates})
    match = difflib.get_close_matches(name.lower(), list(candidates), n=1, cutoff=0.6)
    return candidates[match[0]] if match else None


def _section(cls: type, key: str) -> type | None:
    """The dataclass of section ``key`` of ``cls`` (None for a plain field)."""
    tp = get_type_hints(cls)[config_keys(cls)[key]]
    return tp if dataclasses.is_dataclass(tp) else None


def _dotted_keys(cls: type, prefix: str = ""):
    for key in config_keys(cls):
        yield f"{prefix}{key}"
        if (sub := _section(cls, key)) is not None:
            yield from _dotted_keys(sub, f"{prefix}{key}.")


def suggest_key(cls: type, dotted: str) -> str | None:
    """The dotted key of ``cls`` that a mistyped ``dotted`` most likely meant: each part its section does not
    have replaced by its closest key (``trian.lerning_rate`` -> ``train.lr``); failing that, a key of the same name
    in another section (``model.lr`` -> ``train.lr``). None when neither finds one."""
    parts, fixed, section = dotted.split("."), [], cls
    for i, part in enumerate(parts):
        key = part if part in config_keys(section) else closest_key(part, config_keys(section))
        if key is None:
            break
        fixed.append(key)
        sub = _section(section, key)
        if i == len(parts) - 1:
            return ".".join(fixed) if sub is None else None
        if sub is None:
            break
        section = sub
    leaf = parts[-1].lower()
    return next((k for k in _dotted_keys(cls) if k.rpartition(".")[2] == leaf and k != dotted), None)


def _did_you_mean(suggestion: str | None) -> str:
    return f"did you mean {suggestion!r}? " if suggestion else ""


def from_dict(cls: type, data: dict[str, Any], where: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise ConfigError."""
    hints = get_type_hints(cls)
    keys = config_keys(cls)
    unknown = [k for k in data if k not in keys]
    if unknown:
        loc = f"{where}." if where else ""
        close = closest_key(str(unknown[0]), keys)
        raise ConfigError(
            f"unknown config key {loc}{unknown[0]!r}; {_did_you_mean(close and loc + close)}allowed keys in "
            f"{where or 'the top level'}: {list(keys)}"
        )
    kwargs = {}
    for k, v in data.items():
        kwargs[keys[k]] = _coerce(v, hints[keys[k]], f"{where}.{k}" if where else k)
    return cls(**kwargs)


def to_dict(cfg: Any) -> Any:
    """A config (or any value in it) as plain data under its YAML keys: what ``from_dict`` reads back."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.metadata.get("key", f.name): to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return type(cfg)(to_dict(v) for v in cfg)
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return copy.deepcopy(cfg)


def _parse_scalar(text: str) -> Any:
    """CLI override values are parsed as YAML scalars/flow collections: 4, 1e-3, true, [a, b]."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_override(cfg: Any, dotted: str, raw: str | Any) -> None:
    """Set ``cfg.<dotted>`` from a CLI string (or a Python value), type-checked."""
    parts = dotted.split(".")
    obj = cfg
    name = ""
    for i, p in enumerate(parts):
        keys = config_keys(type(obj))
        if p not in keys:
            where = ".".join(parts[:i]) or "the top level"
            raise ConfigError(f"unknown config key {dotted!r}: {p!r} is not in {where}; "
                              f"{_did_you_mean(suggest_key(type(cfg), dotted))}allowed: {list(keys)}")
        name = keys[p]
        if i < len(parts) - 1:
            obj = getattr(obj, name)
            if not dataclasses.is_dataclass(obj):
                raise ConfigError(f"config key {dotted!r}: {'.'.join(parts[: i + 1])} is not a section")
    value = _parse_scalar(raw) if isinstance(raw, str) else raw
    tp = get_type_hints(type(obj))[name]
    if tp is str and not isinstance(value, str) and isinstance(raw, str):
        value = raw  # `--run.name 123` stays a string
    setattr(obj, name, _coerce(value, tp, dotted))


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """``['--model.n_layers', '4', '--train.seed=3']`` -> ``[('model.n_layers', '4'), ('train.seed', '3')]``."""
    out = []
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or a == "--":
            raise ConfigError(f"expected an override like --section.field VALUE, got {a!r}")
        key = a[2:]
        if "=" in key:
            key, val = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {a!r} has no value; write {a} VALUE")
            val = args[i + 1]
            i += 2
        out.append((key, val))
    return out
