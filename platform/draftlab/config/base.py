"""The shared machinery of every config: `StrictModel`, `ConfigError`, validation errors
that name the file and the field, dotted overrides and YAML loading.

Every model forbids unknown keys, every field carries a docstring, and validation errors
name the field (and, via :func:`load_yaml`, the file) so a typo fails before any work runs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, TypeVar, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Tag, ValidationError

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=False, validate_assignment=True, use_attribute_docstrings=True
    )


def unset(value) -> bool:
    """`exclude_if` of optional fields left out of dumps while unset (None)."""
    return value is None


def _section(model: type[BaseModel] | None, loc: tuple) -> type[BaseModel] | None:
    """The (nested) model that the path `loc` points into, if it is a model."""
    for part in loc:
        if model is None:
            return None
        if isinstance(part, int) or part not in model.model_fields:
            continue  # a list index / dict key: stay on the item type found below
        ann = model.model_fields[part].annotation
        candidates = [ann, *get_args(ann)]
        candidates += [a for c in list(candidates) for a in get_args(c)]
        model = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
    return model


TAG = "tag:"
"""Prefix of the tags of tagged unions (`one_or_list`), which error paths leave out."""


def one_or_list(one: type[BaseModel], item: type[BaseModel]):
    """The type of a field that takes one `one` or a list of `item`s: a tagged union, so an
    error names the field path alone (`data.source.kind`, `data.source.1.kind`), not every
    union member's."""
    return Annotated[
        Annotated[one, Tag(f"{TAG}one")] | Annotated[list[item], Tag(f"{TAG}list")],
        Discriminator(lambda v: f"{TAG}list" if isinstance(v, list) else f"{TAG}one"),
    ]


def format_validation_error(
    err: ValidationError, source: str, model: type[BaseModel] | None = None
) -> str:
    """One line per problem: `source: field.path: message`; an unknown key lists the keys
    its section allows (when `model` is given), a bad choice the allowed values."""
    lines = [f"invalid configuration in {source}:"]
    for e in err.errors():
        path = [p for p in e["loc"] if not (isinstance(p, str) and p.startswith(TAG))]
        loc = ".".join(str(p) for p in path) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            section = _section(model, e["loc"][:-1])
            msg = "unknown key" + (
                f" (allowed: {', '.join(section.model_fields)})" if section else ""
            )
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names file and field."""


class _YamlLoader(yaml.SafeLoader):
    """YAML with `true`/`false` as its only booleans (YAML 1.2): `on`, `off`, `yes` and `no` stay
    words, so `speculation: on` or `prompt_lookup=on` means the value of that name. Boolean
    fields still take them (pydantic reads "on" and "yes" as true)."""


_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def yaml_load(text: str):
    """`yaml.safe_load` with YAML 1.2 booleans (`_YamlLoader`): configs and overrides."""
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 -- a SafeLoader subclass


def parse_overrides(items: list[str]) -> dict:
    """`["train.lr=1e-4", "data.source.kind=dataset"]` -> {dotted key: YAML-typed value}."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        try:
            out[key] = yaml_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from None
    return out


def apply_dotted(data: dict, overrides: dict) -> dict:
    """Set `{"a.b": 1}`-style dotted keys in the nested mapping `data` (in place)."""
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {dotted!r}: {p!r} is a value, not a section")
            node = child
        node[leaf] = value
    return data


def read_mapping(path: str | Path) -> dict:
    """The top-level mapping of a YAML file; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def load_yaml(model: type[M], path: str | Path, overrides: dict | None = None) -> M:
    """Load a YAML file into `model`, applying dotted `overrides` (`a.b=1`) on top."""
    data = apply_dotted(read_mapping(path), overrides or {})
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, str(path), model)) from None
