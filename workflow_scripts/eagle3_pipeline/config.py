"""Config validation against ``config/schema.yaml``: defaults filled, unknown keys rejected."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import jsonschema
import yaml

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"


class ConfigError(ValueError):
    """The configuration does not match the schema; the message lists every problem."""


def _with_defaults(validator_class):
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


def load_schema(path: str | os.PathLike = SCHEMA_PATH) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def validate_config(config: dict, schema_path: str | os.PathLike = SCHEMA_PATH) -> dict:
    """Return a copy of ``config`` with defaults filled in, after validating it.

    Raises:
        ConfigError: listing each violation as ``<key path>: <message>``, e.g.
            ``training.lrr: Additional properties are not allowed ('lrr' was unexpected)``.
    """
    schema = load_schema(schema_path)
    cfg = copy.deepcopy(config) if config else {}
    validator = _with_defaults(jsonschema.Draft7Validator)(schema)
    errors = sorted(validator.iter_errors(cfg), key=lambda e: list(e.absolute_path))
    if errors:
        lines = []
        for e in errors:
            where = ".".join(str(p) for p in e.absolute_path) or "<top level>"
            lines.append(f"  {where}: {e.message}")
        raise ConfigError("invalid configuration (see config/schema.yaml):\n" + "\n".join(lines))
    return cfg
