"""Checking a command's settings: unknown keys (with the nearest valid one), values out of range, typed objects.

The schemas are in struct mode, but Hydra's `+key=value` adds a key to any config, and a typo without the `+`
fails inside Hydra with a hint that suggests the `+` form. Both are caught here, naming the nearest valid key:
`check_overrides` looks at the command line before Hydra composes it (an argument Hydra's lexer rejects is named
with the quoting that reads back as its value: `parse_overrides`), `check_config` at the composed config.
`typed` turns a composed config into its schema's dataclass, once, in the CLI.

The head's settings are flat on the command line and in the YAML (`head.block_size=16`), typed in `HeadConfig`
(the shared ones, and `settings`, the type's own): Hydra composes them as one mapping (`hydra_schema`), a
`head.<key>` is checked against the shared keys and the chosen type's settings (another type's setting names that
type), and `typed` builds the `HeadConfig` with `HeadConfig.from_dict`.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import functools
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from mtp_train.config.errors import ConfigError
from mtp_train.config.eval import EvalConfig
from mtp_train.config.export import ExportConfig
from mtp_train.config.head import HEAD_TYPES, HeadConfig, flat_schema, head_key_problem, without_legacy_keys
from mtp_train.config.precompute import PrecomputeConfig
from mtp_train.config.regenerate import RegenerateConfig
from mtp_train.config.serve import ServeConfig
from mtp_train.config.train import TrainConfig

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")  # the YAML tree (an editable install's checkout)
T = TypeVar("T")

SCHEMAS: dict[str, type] = {
    "precompute": PrecomputeConfig,
    "regenerate": RegenerateConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
    "export": ExportConfig,
    "serve": ServeConfig,
}

# Lower bounds of numeric settings: key → (smallest value, what the key must be). Keys a command does not have
# are not looked at; null stays allowed wherever the schema allows it.
_POSITIVE = "a positive integer"
LOWER_BOUNDS: dict[str, tuple[float, str]] = {
    "limit": (1, "null (everything) or a positive integer"),
    "max_seq_len": (1, _POSITIVE), "shard_tokens": (1, _POSITIVE), "batch_tokens": (1, _POSITIVE),
    "n": (1, _POSITIVE), "max_new_tokens": (1, _POSITIVE), "max_batch_size": (1, _POSITIVE),
    "max_prompt_tokens": (1, _POSITIVE), "concurrency": (1, _POSITIVE), "retries": (0, "0 (no retry) or more"),
    "timeout": (0.001, "a positive number of seconds"), "template_check_rows": (0, "0 (no check) or more"),
    "batch_size": (1, _POSITIVE), "top_k": (0, "0 (off) or more"),
    "model.page_size": (1, _POSITIVE), "model.tp": (1, _POSITIVE),
    "train.max_steps": (1, "a positive integer (the optimizer steps of the whole run)"),
    "train.max_seconds": (0, "0 (no wall-clock limit) or more seconds"),
    "train.micro_batch_tokens": (1, _POSITIVE), "train.grad_accum": (1, _POSITIVE),
    "train.eval_every": (0, "0 (only at the end) or more"), "train.eval_batches": (0, "0 (no evaluation) or more"),
    "train.save_every": (0, "0 (only at the end) or more"), "train.log_every": (1, _POSITIVE),
    "optim.warmup_steps": (0, "0 or more"), "data.num_workers": (0, "0 or more"), "loss.steps": (1, _POSITIVE),
    "spec_eval.limit": (1, _POSITIVE), "spec_eval.k": (1, _POSITIVE), "spec_eval.max_new_tokens": (1, _POSITIVE),
    "spec_eval.batch_size": (1, _POSITIVE),
    "data.online.max_seq_len": (1, _POSITIVE), "data.online.shard_tokens": (1, _POSITIVE),
    "data.online.limit": (1, "null (everything) or a positive integer"),
    "vllm.max_num_seqs": (1, _POSITIVE), "vllm.max_num_batched_tokens": (1, "null (vLLM's default) or positive"),
    "vllm.tensor_parallel_size": (1, _POSITIVE), "vllm.cpu_kvcache_gb": (1, _POSITIVE),
    "backoff": (0, "0 or more seconds"), "dead_after": (0, "0 or more seconds"),
    "vllm.concurrency": (1, _POSITIVE), "vllm.retries": (0, "0 (no retry) or more"),
    "vllm.timeout": (0.001, "a positive number of seconds"), "vllm.backoff": (0, "0 or more seconds"),
    "vllm.dead_after": (0, "0 or more seconds"),
    "window": (1, "a positive integer (conversations read and tokenized at a time)"),
}


def _classify(hint: Any) -> tuple[str, Any]:
    """("dataclass", cls) | ("open", None): any sub-key (dicts, Any) | ("list", None) | ("leaf", None)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _classify(args[0]) if len(args) == 1 else ("open", None)
    if hint is Any or origin in (dict, collections.abc.Mapping) or hint is dict:
        return "open", None
    if origin is list or hint is list:
        return "list", None
    if dataclasses.is_dataclass(hint):
        return "dataclass", hint
    return "leaf", None


def _fields(schema: type) -> dict[str, Any]:
    # A head's settings are flat keys: the shared ones and every registered type's own (which of them the chosen
    # type takes is `head_key_problem`'s to say), never `settings`.
    return _all_head_keys() if schema is HeadConfig else typing.get_type_hints(schema)


def _all_head_keys() -> dict[str, Any]:
    """The flat `head.<key>`s of every registered head type, with their type hints."""
    out: dict[str, Any] = {}
    for name in HEAD_TYPES.names():
        out.update({k: v for k, v in typing.get_type_hints(flat_schema(name)).items() if k not in out})
    return out


def head_fields(schema: type) -> list[str]:
    """The settings of `schema` that hold a `HeadConfig` (TrainConfig's `head`)."""
    if not dataclasses.is_dataclass(schema):
        return []
    return [name for name, hint in typing.get_type_hints(schema).items() if hint is HeadConfig]


@functools.cache
def hydra_schema(schema: type) -> type:
    """`schema` as Hydra composes it: each `HeadConfig` setting a flat mapping of `head.<key>`s (the YAML's and the
    command line's form, whose keys depend on the head type; `check_config` checks them); `schema` itself when it
    has none. A subclass of `schema`: building it (`OmegaConf.to_object` of a composed config) types each head with
    `typed_head` and runs `schema`'s own checks, so it is a valid `schema` (`typed` gives the `schema` itself)."""
    heads = head_fields(schema)
    if not heads:
        return schema
    hints = typing.get_type_hints(schema)
    fields = [(f.name, dict[str, Any], dataclasses.field(default_factory=dict)) if f.name in heads else
              (f.name, hints[f.name], dataclasses.field(default=f.default, default_factory=f.default_factory))
              for f in dataclasses.fields(schema)]

    def __post_init__(self: Any) -> None:
        for h in heads:
            if not isinstance(getattr(self, h), HeadConfig):
                setattr(self, h, typed_head(dict(getattr(self, h)), h))
        if hasattr(schema, "__post_init__"):
            schema.__post_init__(self)

    flat = dataclasses.make_dataclass(schema.__name__, fields, bases=(schema,),
                                      namespace={"__post_init__": __post_init__, "flat_of": schema})
    flat.__module__ = schema.__module__
    return flat


def _head_key_error(key: str, head_type: str | None) -> ConfigError | None:
    """The error for dotted `key` below a head setting (`head.<name>`) that head type `head_type` lacks, or None (a
    key every type lacks when the type is not known)."""
    field_name, _, name = key.partition(".")
    if head_type is None or head_type not in HEAD_TYPES:  # an unknown type is HeadConfig's to name
        problem = None if name in _all_head_keys() else head_key_problem(HeadConfig.type, name)
    else:
        problem = head_key_problem(head_type, name)
    return ConfigError(problem.replace("`head.", f"`{field_name}.").replace("head.", f"{field_name}.", 1)
                       if field_name != "head" else problem) if problem else None


def schema_keys(schema: type, prefix: str = "") -> list[str]:
    """Every dotted key of `schema` (nested dataclasses expanded), for suggestions."""
    out = []
    for name, hint in _fields(schema).items():
        key = f"{prefix}{name}"
        out.append(key)
        kind, sub = _classify(hint)
        if kind == "dataclass":
            out.extend(schema_keys(sub, key + "."))
    return out


def is_schema_key(schema: type, key: str) -> bool:
    """Whether dotted `key` names a setting of `schema` (anything below a dict-valued setting is one)."""
    parts = key.split(".")
    node: Any = schema
    for i, part in enumerate(parts):
        hints = _fields(node)
        if part not in hints:
            return False
        kind, sub = _classify(hints[part])
        rest = parts[i + 1:]
        if kind == "open" or not rest:
            return True
        if kind == "list":
            return len(rest) == 1 and rest[0].isdigit()
        if kind == "leaf":
            return False
        node = sub
    return True


def unknown_key_error(schema: type, key: str, name: str) -> ConfigError:
    """The error for `key`, which `schema` lacks: names the nearest valid key (difflib), or the valid ones."""
    valid = schema_keys(schema)
    parent = key
    while "." in parent:  # the deepest part of the key that does name a group of settings (train, data.…)
        parent = parent.rsplit(".", 1)[0]
        if any(k.startswith(parent + ".") for k in valid):
            break
    else:
        parent = ""
    prefix = parent + "." if parent else ""
    near = difflib.get_close_matches(key, [k for k in valid if k.startswith(prefix)], n=1, cutoff=0.6)
    if near:
        hint = f"did you mean `{near[0]}`?"
    else:
        children = sorted(k[len(prefix):] for k in valid if k.startswith(prefix) and "." not in k[len(prefix):])
        hint = f"the keys{' under `' + parent + '`' if parent else ''} are: {', '.join(children)}"
    return ConfigError(f"unknown config key `{key}` (conf/{name}.yaml's schema has no such setting); {hint}")


def _flat_keys(node: Any, schema: type, prefix: str = "") -> list[str]:
    """Dotted keys of a composed config, not descending below settings whose values are dicts."""
    out = []
    hints = _fields(schema)
    for k in node:
        key = f"{prefix}{k}"
        if k not in hints:
            out.append(key)
            continue
        kind, sub = _classify(hints[k])
        value = node[k]
        if kind == "dataclass" and hasattr(value, "keys"):
            out.extend(_flat_keys(value, sub, key + "."))
        else:
            out.append(key)
    return out


def check_config(cfg: Any, name: str) -> Any:
    """Refuse a composed config of command `name` with a key its schema lacks or a value out of range; return it.

    `+key=value` on the command line adds keys that the schema does not have (Hydra allows it); they would be
    ignored, so a mistyped setting would silently keep its default.
    """
    schema = SCHEMAS[name]
    heads = head_fields(schema)
    for key in _flat_keys(cfg, schema):
        if key.split(".")[0] in heads and "." in key:
            node = cfg.get(key.split(".")[0])
            error = _head_key_error(key, str(node.get("type", HeadConfig.type)) if hasattr(node, "get") else None)
            if error:
                raise error
        elif not is_schema_key(schema, key):
            raise unknown_key_error(schema, key, name)
    for key, (low, what) in LOWER_BOUNDS.items():
        node, parts = cfg, key.split(".")
        for part in parts:
            node = node.get(part) if hasattr(node, "get") else None
            if node is None:
                break
        if isinstance(node, (int, float)) and not isinstance(node, bool) and node < low:
            raise ConfigError(f"{key}={node} is out of range: `{key}` must be {what}")
    return cfg


def _quoted(value: str) -> str:
    """`value` as one quoted Hydra string: in single quotes, a quote inside it escaped (and the backslashes right
    before a quote or at the end doubled, the only ones Hydra reads as escapes)."""
    return "'" + re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), value) + "'"


def _shell(arg: str) -> str:
    """`arg` as one shell word: in double quotes, or in bash's $'...' when it holds a line break or control
    character (so that the hint stays on one line)."""
    if not arg.isprintable():
        named = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\\": "\\\\", "'": "\\'"}
        return "$'" + "".join(named.get(c, c if c.isprintable() else f"\\u{ord(c):04x}") for c in arg) + "'"
    return '"' + re.sub(r'(["$`\\])', r"\\\1", arg) + '"'


def _reads_back(parser: Any, arg: str, value: str) -> bool:
    """Whether Hydra reads `arg` as a setting whose value is the string `value`."""
    from hydra.errors import OverrideParseException

    try:
        return parser.parse_overrides([arg])[0].value() == value
    except OverrideParseException:
        return False


def _how_to_write(parser: Any, args: list[str], k: int) -> str:
    """What to do about argument `k`, which Hydra's lexer rejects."""
    arg = args[k]
    key, eq, value = arg.partition("=")
    if not eq:
        if k > 0 and "=" in args[k - 1]:
            # `out=my dir` unquoted: the shell made two arguments of it.
            prev_key, _, prev_value = args[k - 1].partition("=")
            joined = f"{prev_key}={_quoted(prev_value + ' ' + arg)}"
            if _reads_back(parser, joined, prev_value + " " + arg):
                return (f"a setting is key=value; if it is the rest of {args[k - 1]!r} after a space, quote the "
                        f"whole value: {_shell(joined)}")
        return "a setting is key=value"
    fixed = f"{key}={_quoted(value)}"
    hint = (f"quote the value: {_shell(fixed)}" if _reads_back(parser, fixed, value) else
            "quote the value in single quotes, a quote inside it written \\'")
    if value.lstrip().startswith("[") and not value.rstrip().endswith("]"):
        hint = f"close the list with ], or, if [ is part of the value, {hint}"
    return hint


def parse_overrides(overrides: list[str]) -> list[Any]:
    """Hydra's parse of each command-line override; an argument its lexer rejects (or one holding bytes that are not
    UTF-8) is a ConfigError naming the argument and how to write it instead, never Hydra's traceback."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    parsed = []
    for k, arg in enumerate(overrides):
        at = next((i for i, c in enumerate(arg) if "\udc80" <= c <= "\udcff"), None)
        if at is not None:  # the command line decodes bytes that are not UTF-8 to lone surrogates
            raise ConfigError(f"argument {arg!r} holds a byte that is not UTF-8 (\\x{ord(arg[at]) - 0xDC00:02x} at "
                              f"character {at}): settings are text; rename the file or folder to a UTF-8 name "
                              f"(or link it under one) and pass that")
        try:
            parsed.extend(parser.parse_overrides([arg]))
        except OverrideParseException as exc:
            why = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
            raise ConfigError(f"argument {arg!r} is not a setting Hydra can read ({why[:120]}): "
                              f"{_how_to_write(parser, overrides, k)}") from None
    return parsed


def check_overrides(overrides: list[str], name: str) -> None:
    """Refuse command-line overrides naming a key or a config-group choice that command `name` does not have.

    Run before Hydra composes: Hydra's own error for a typo suggests adding the key with `+`, which would only
    make the typo silent. Overrides of Hydra's own settings (`hydra.*`, `hydra/...`) are left to Hydra.
    """
    schema = SCHEMAS[name]
    conf = Path(CONF_DIR)
    parsed = parse_overrides(overrides)
    heads = head_fields(schema)
    for o in parsed:
        key = o.key_or_group
        if o.is_delete() or o.package or key.startswith("hydra") or "/" in key:
            continue
        group = conf / key
        if "." not in key and group.is_dir():
            value = o.value()
            if isinstance(value, str) and not (group / f"{value}.yaml").is_file():
                choices = sorted(p.stem for p in group.glob("*.yaml"))
                near = difflib.get_close_matches(value, choices, n=1)
                hint = f"did you mean `{key}={near[0]}`? " if near else ""
                raise ConfigError(f"`{key}={value}`: there is no conf/{key}/{value}.yaml; {hint}"
                                  f"choose one of {', '.join(choices)}")
            continue
        if key.split(".")[0] in heads and "." in key:
            error = _head_key_error(key, _chosen_head_type(parsed, key.split(".")[0], name))
            if error:
                raise error
        elif not is_schema_key(schema, key):
            raise unknown_key_error(schema, key, name)
        _check_type(schema, key, o)


def _chosen_head_type(parsed: list[Any], field_name: str, name: str) -> str | None:
    """The head type a command line chooses for head setting `field_name` before Hydra composes it: the last
    `head=<type>` or `head.type=<type>`, else the root config's default (`conf/<name>.yaml`'s defaults list); None
    when another config group (an experiment) may choose it."""
    chosen = None
    for o in parsed:
        key = o.key_or_group
        if key in (field_name, f"{field_name}.type") and not o.is_delete():
            value = o.value()
            chosen = value if isinstance(value, str) else chosen
        elif "." not in key and "/" not in key and key not in ("model", "data", "deepspeed") \
                and (Path(CONF_DIR) / key).is_dir():
            return None  # e.g. +experiment=...: its file may choose the head
    if chosen is not None:
        return chosen
    import yaml

    root = Path(CONF_DIR) / f"{name}.yaml"
    defaults = (yaml.safe_load(root.read_text(encoding="utf-8")) or {}).get("defaults", []) if root.is_file() else []
    for entry in defaults:
        if isinstance(entry, dict) and isinstance(entry.get(field_name), str):
            return str(entry[field_name])
    return HeadConfig.type


def leaf_hint(schema: type, key: str) -> Any:
    """The type hint of dotted `key` in `schema` (None when it is below a dict or list setting)."""
    node: Any = schema
    hint: Any = None
    for part in key.split("."):
        if not dataclasses.is_dataclass(node):
            return None
        hint = _fields(node).get(part)
        kind, sub = _classify(hint)
        node = sub if kind == "dataclass" else None
    return hint


def _describe_hint(hint: Any) -> str:
    """How a type reads in an error message: "an integer", "a list (e.g. [a,b])", "an integer or null", ..."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [_describe_hint(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in args else "")
    if origin is list or hint is list:
        return "a list, e.g. [a,b]"
    if origin in (dict, collections.abc.Mapping) or hint is dict:
        return "a mapping, e.g. {a:1}"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _check_type(schema: type, key: str, override: Any) -> None:
    """Refuse an override whose value does not convert to the setting's type, naming the key and the type.

    Hydra would refuse it too, at composition, but with several lines and exit code 1.
    """
    hint = leaf_hint(schema, key)
    if hint is None:
        return
    try:
        value = override.value()
    except Exception:  # a sweep or a function: Hydra's to handle
        return
    if not isinstance(value, (str, int, float, bool, list, dict, type(None))):
        return
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        OmegaConf.merge(OmegaConf.structured(dataclasses.make_dataclass("One", [("v", hint)])), {"v": value})
    except OmegaConfBaseException:
        raw = override.get_value_element_as_str()
        raise ConfigError(f"`{key}={raw}`: `{key}` takes {_describe_hint(hint)}, not {raw!r}") from None
    except Exception:  # a hint OmegaConf cannot build a node for: Hydra checks it
        return


def typed(cfg: Any, schema: type[T]) -> T:
    """`cfg` (a composed DictConfig, a dict of overrides of the defaults, or already a `schema`) as a validated
    `schema` instance: the dataclasses' own checks (`__post_init__`) run here. A head setting's flat keys become a
    `HeadConfig` (`typed_head`)."""
    if isinstance(cfg, schema) and getattr(type(cfg), "flat_of", None) is not schema:
        return cfg
    from omegaconf import OmegaConf

    heads = head_fields(schema)
    if not heads:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    if isinstance(cfg, collections.abc.Mapping) or hasattr(cfg, "keys"):
        cfg = {k: (v.to_dict() if isinstance(v, HeadConfig) else v) for k, v in cfg.items()}
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):  # hydra_schema's subclass: checked already
        flat = cfg
    else:
        merged = OmegaConf.merge(_declared_nulls(OmegaConf.structured(hydra_schema(schema)), schema), cfg)
        flat = OmegaConf.to_object(merged)  # every setting typed and checked, the heads typed by typed_head
    return schema(**{f.name: getattr(flat, f.name) for f in dataclasses.fields(schema)})


def _declared_nulls(node: Any, schema: type) -> Any:
    """`node` (a structured config of `schema`) with each setting whose declared default is null set back to null
    where its default instance's `__post_init__` filled it in (loss.steps: null until the head's derived value is
    taken, `TrainConfig.apply_derived`)."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        kind, sub = _classify(hints[f.name])
        if f.default is None and node.get(f.name) is not None:
            node[f.name] = None
        elif kind == "dataclass" and sub is not HeadConfig and hasattr(node.get(f.name), "keys"):
            _declared_nulls(node[f.name], sub)
    return node


def plain(cfg: Any) -> dict[str, Any]:
    """A settings dataclass (TrainConfig) as plain nested values, each head flat as the user says it
    (`HeadConfig.to_dict(resolve=False)`): what a run records in YAML."""
    out = dataclasses.asdict(cfg)
    for h in head_fields(type(cfg)):
        out[h] = getattr(cfg, h).to_dict(resolve=False)
    return out


def typed_head(flat: collections.abc.Mapping[str, Any], field_name: str = "head") -> HeadConfig:
    """A `HeadConfig` from its flat keys (`head.<key>` as composed), each key checked against the type's (a key of
    another type names it) and each value against the key's type, as Hydra checks the rest."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    name = str(flat.get("type", HeadConfig.type))
    if name not in HEAD_TYPES:
        return HeadConfig.from_dict(flat)  # names the known types
    keys = without_legacy_keys(flat)
    for key in keys:
        error = _head_key_error(f"{field_name}.{key}", name)
        if error:
            raise error
    schema = flat_schema(name)
    hints = typing.get_type_hints(schema)
    try:
        values = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(schema), keys))
    except OmegaConfBaseException as exc:
        key = str(getattr(exc, "full_key", "") or "?").split(".")[-1]
        raise ConfigError(f"`{field_name}.{key}={keys.get(key)}`: `{field_name}.{key}` takes "
                          f"{_describe_hint(hints.get(key))}, not {keys.get(key)!r}") from None
    assert isinstance(values, dict)
    return HeadConfig.from_dict({k: values[k] for k in keys})
