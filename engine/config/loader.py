"""Loading a ``TesselConfig``: TOML files and presets, dotted ``--set`` overrides, argparse glue.

``load_config("tiny_llama_cpu", ["optim.lr=1e-3", "parallel.tp=1"])`` reads configs/<name>.toml
(or any TOML path), applies the overrides in order (each parsed by the type of the field it
targets), builds the config (which validates itself) and records the file and the overrides.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tomllib
from typing import Any, Callable

from engine.config._fields import Section, field_types, parse_text, unknown_key_error
from engine.config.schema import METADATA, SECTIONS, TesselConfig

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def configs_dir() -> str:
    """The directory holding the TOML presets (``<repo>/configs``)."""
    return os.path.join(_REPO_ROOT, "configs")


def available_presets() -> list[str]:
    """Names of the presets in ``configs_dir()`` (file names without ``.toml``), sorted."""
    folder = configs_dir()
    if not os.path.isdir(folder):
        return []
    return sorted(f[:-len(".toml")] for f in os.listdir(folder) if f.endswith(".toml"))


def resolve_preset(name: str) -> str:
    """Absolute path of preset ``name`` ("tiny_llama_cpu" or "tiny_llama_cpu.toml")."""
    stem = name[:-len(".toml")] if name.endswith(".toml") else name
    path = os.path.join(configs_dir(), f"{stem}.toml")
    if not os.path.isfile(path):
        presets = available_presets()
        if not presets:
            raise ValueError(f"no preset '{stem}': {configs_dir()} holds no .toml files")
        raise unknown_key_error(stem, valid=presets, where=configs_dir(), what="preset")
    return path


def _read_toml(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"{path}: invalid TOML: {err}") from None
    for key in METADATA:
        if key in data:
            raise ValueError(f"{path}: '{key}' is recorded automatically when loading; remove it "
                             "from the file")
    return data


def _subtable(parent: dict, key: str, *, where: str = "") -> dict:
    table = parent.setdefault(key, {})
    if not isinstance(table, dict):
        raise ValueError(f"[{where + '.' if where else ''}{key}] must be a table of keys, got {type(table).__name__}")
    return table


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of the nested dict ``data`` with each ``section.key=value`` applied in order."""
    out = copy.deepcopy(data)
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise ValueError(f"--set expects SECTION.KEY=VALUE, got {item!r}; e.g. --set "
                             "optim.lr=3e-4")
        key, text = item.split("=", 1)
        section, dot, name = key.strip().partition(".")
        if not dot or not name:
            raise ValueError(f"--set {item!r}: the key must be dotted SECTION.KEY, e.g. optim.lr; "
                             f"sections: {', '.join(SECTIONS)}")
        if section not in SECTIONS:
            raise unknown_key_error(section, valid=list(SECTIONS), where=f"--set {item!r}",
                                    what="section")
        cls, table, where = SECTIONS[section], _subtable(out, section), section
        *parents, name = name.split(".")
        for sub in parents:  # nested sections: posttrain.lora.rank
            types = field_types(cls)
            if sub not in types or not (isinstance(types[sub], type) and issubclass(types[sub], Section)):
                raise unknown_key_error(sub, valid=[k for k, t in types.items() if isinstance(t, type)
                                                    and issubclass(t, Section)] or list(types),
                                        where=f"section [{where}] (--set {item!r})", what="sub-section")
            cls, table, where = types[sub], _subtable(table, sub, where=where), f"{where}.{sub}"
        types = field_types(cls)
        if name not in types:
            elsewhere = [f"{s}.{name}" for s, c in SECTIONS.items() if s != section and name in field_types(c)]
            raise unknown_key_error(name, valid=list(types), where=f"section [{where}] (--set {item!r})",
                                    elsewhere=elsewhere)
        if isinstance(types[name], type) and issubclass(types[name], Section):  # a table, not a value
            keys = list(field_types(types[name]))
            raise ValueError(f"--set {item!r}: {where}.{name} is a table of keys ({', '.join(keys)}), not a value; "
                             f"set one of its keys, e.g. --set {where}.{name}.{keys[0]}=...")
        table[name] = parse_text(text, types[name], name=f"{where}.{name}")
    return out


def load_config(path: str | None, overrides: list[str], *,
                defaults: Callable[[dict[str, Any]], None] | None = None) -> TesselConfig:
    """Build a validated config from a TOML file or preset name (or nothing) plus overrides.

    ``path`` is an existing file, else a preset name in configs/; a missing path that looks like a
    file (has a '/' or ends in '.toml') is reported as a missing file. ``model.hf_config``, when
    set, must exist (it defines the architecture).
    """
    if path is None:
        data, source = {}, None
    else:
        bare = "/" not in path and os.sep not in path
        stem = path[:-len(".toml")] if path.endswith(".toml") else path
        if os.path.isfile(path):
            source = os.path.abspath(path)
        elif bare and (stem == path or stem in available_presets()):
            source = resolve_preset(path)
        else:
            raise ValueError(f"config file {path!r} does not exist (resolved to "
                             f"{os.path.abspath(path)}); pass an existing TOML file or a preset "
                             f"name: {', '.join(available_presets())}")
        data = _read_toml(source)
    data = apply_overrides(data, list(overrides))
    if defaults is not None:  # keys derived from others before validation (tools/posttrain.py: the base model)
        defaults(data)
    data["source"] = source
    data["overrides"] = list(overrides)
    try:
        config = TesselConfig.from_dict(data)
    except ValueError as err:
        if source is None:
            raise
        raise ValueError(f"{source}{' with --set overrides' if overrides else ''}: {err}") from None
    hf = config.model.hf_config
    if hf is not None and not os.path.isfile(hf):
        raise ValueError(f"model.hf_config={hf!r} does not exist (resolved to "
                         f"{os.path.abspath(hf)}); point it at a Hugging Face config.json")
    return config


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--config PATH_OR_PRESET`` and repeatable ``--set SECTION.KEY=VALUE`` to ``parser``."""
    group = parser.add_argument_group("config")
    group.add_argument("--config", default=None, metavar="PATH_OR_PRESET",
                       help="TOML config file, or a preset name from configs/ ("
                            + ", ".join(available_presets()) + ")")
    group.add_argument("--set", dest="config_overrides", action="append", default=None,
                       metavar="SECTION.KEY=VALUE",
                       help="override one field, e.g. --set optim.lr=3e-4 (repeatable; lists as "
                            "a,b or [1, 2]; 'none' for optional fields)")


def config_from_args(args: argparse.Namespace) -> TesselConfig:
    """The config named by the arguments ``add_config_args`` added."""
    return load_config(args.config, args.config_overrides or [])


def main(argv: list[str] | None = None) -> int:
    """``python -m engine.config --config X [--set K=V ...] [--world-size N]``: print the
    resolved config as JSON (exit status 2 and the error on stderr when it is invalid)."""
    parser = argparse.ArgumentParser(prog="python -m engine.config", description=main.__doc__)
    add_config_args(parser)
    parser.add_argument("--world-size", type=int, default=None,
                        help="also check the degrees against this many processes and resolve dp")
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        if args.world_size is not None:
            config = config.with_world_size(args.world_size)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(config.to_dict(), sort_keys=True, indent=2))
    return 0
