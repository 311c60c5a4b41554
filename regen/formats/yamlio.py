"""Reading and writing versioned YAML documents (profiles and plans).

Plans are written in YAML's block style, for people to read. Profiles are large and written by a
machine, so they are written as JSON text (`dump_document(..., as_json=True)`, Note [ JSON that YAML
reads alike ]): YAML readers read it to the same document, and regen parses it about 100x faster than
YAML (a 32-layer decoder's 4 MB profile: 0.04 s against 4 s with libyaml). A reader tries JSON first and
YAML otherwise, with PyYAML's C loader and dumper when libyaml is present and the pure-Python ones
otherwise. Every document carries a `format` key of the form `regen-<kind>/<version>`; a reader refuses
another kind or an unknown version with a message that names the file, what it found and what it expected.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import types
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import yaml

from regen.errors import FormatError

try:  # libyaml bindings: ~10x faster on large profiles
    _Loader = yaml.CSafeLoader
    _Dumper = yaml.CSafeDumper
except AttributeError:  # pragma: no cover - depends on how PyYAML was built
    _Loader = yaml.SafeLoader
    _Dumper = yaml.SafeDumper


def check_output_path(path: str | Path, inputs: tuple[str | Path, ...] = (), what: str = "-o") -> Path:
    """`path` as a file regen may write, checked before any long work: not empty, not a directory, in a
    directory that exists and is writable, and not one of `inputs` (an input is never overwritten)."""
    if path is None or not str(path).strip():
        raise FormatError(f"{what}: the output path is empty")
    path = Path(path)
    if path.is_dir():
        raise FormatError(f"{what} {path}: is a directory; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.exists():
        raise FormatError(f"{what} {path}: the directory {parent} does not exist")
    if not parent.is_dir():
        raise FormatError(f"{what} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise FormatError(f"{what} {path}: the directory {parent} is not writable")
    for source in inputs:
        if path.exists() and Path(source).exists() and os.path.samefile(path, source):
            raise FormatError(f"{what} {path}: is the input file; write the output to another path")
    return path


def dump_document(document: dict[str, Any], path: str | Path, as_json: bool = False) -> None:
    """Write `document` to `path`, atomically: a crash or a write error never leaves half a file or a
    temporary file behind. As YAML's block style, or with `as_json` as JSON text that YAML reads alike
    (falling back to the block style for a document JSON cannot carry so: `json_text`)."""
    path = check_output_path(path)
    text = json_text(document) if as_json else None
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            if text is not None:
                f.write(text)
            else:
                yaml.dump(document, f, Dumper=_Dumper, sort_keys=False, default_flow_style=None, width=120)
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise FormatError(f"{path}: cannot write ({exc.strerror or exc})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# NOTE [ JSON that YAML reads alike ]
# JSON is nearly a subset of YAML 1.1, which PyYAML reads; `json_text` writes only the part that is:
# 1. a float is written with a dot before its exponent (`1.0e-05`; Python's `1e-05` is a string to YAML 1.1);
# 2. no NaN or infinity (JSON has none; the document is written as YAML instead);
# 3. no escaped surrogate pair (other characters are escaped as `\u00e9`, alike in both; YAML decodes
#    `\ud83d\ude00` as two characters): else YAML;
# 4. string keys only (JSON would turn `{1: x}` into `{"1": x}`): else YAML;
# 5. one item of each top-level list per line, indented, so that the file reads and diffs line by line.
# tests/formats/test_yamlio.py reads what it writes with both parsers and compares.
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|(?<![\d.])(-?\d+)(e[-+]\d+)')
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89abAB]")


def _with_dot_before_exponent(match: re.Match) -> str:
    return match.group(0) if match.group(1) is None else f"{match.group(1)}.0{match.group(2)}"


def _keys_are_strings(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _keys_are_strings(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_keys_are_strings(v) for v in value)
    return True


def json_text(document: dict[str, Any]) -> str | None:
    """`document` as JSON text that YAML reads to the same document (Note [ JSON that YAML reads alike ]),
    or None where no such text exists."""
    def encode(value) -> str:
        return json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(", ", ": "))

    if not _keys_are_strings(document):
        return None
    items = []
    try:
        for key, value in document.items():
            if isinstance(value, list) and value:
                items.append(f"{encode(key)}: [\n  " + ",\n  ".join(encode(v) for v in value) + "]")
            else:
                items.append(f"{encode(key)}: {encode(value)}")
    except (ValueError, TypeError):  # NaN or infinity; a value JSON has no type for
        return None
    text = "{" + ",\n ".join(items) + "}\n"
    if _ESCAPED_SURROGATE.search(text):
        return None
    return _JSON_TOKEN.sub(_with_dot_before_exponent, text)


def read_document(path: str | Path, kind: str = "file") -> dict[str, Any]:
    """Parse the YAML document at `path`: a mapping with a `format` key, whatever its kind."""
    path = Path(path)
    if not path.exists():
        raise FormatError(f"{path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
        document = _json_document(text)
        if document is None:
            document = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())  # one line: the CLI prints errors on a single line
        raise FormatError(f"{path}: not valid YAML ({detail})") from None
    except UnicodeDecodeError:
        raise FormatError(f"{path}: not a text file") from None
    except OSError as exc:  # a directory, no permission to read
        raise FormatError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not isinstance(document, dict) or "format" not in document:
        raise FormatError(f"{path}: not a regen {kind} (no 'format' key at the top)")
    return document


_REGEN_JSON_HEAD = re.compile(r'\{\s*"format"\s*:\s*"regen-')


def opens_a_regen_json_document(head: str) -> bool:
    """`head` (a file's first characters, leading blanks stripped) opens a regen document written as JSON
    text: `json_text` writes keys in the document's order, and profiles and plans put `format` first."""
    return bool(_REGEN_JSON_HEAD.match(head))


def _json_document(text: str) -> Any:
    """The document of JSON `text` (how profiles are written), or None when it is not JSON: then YAML."""
    if not text.lstrip().startswith("{"):
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def document_kind(document: dict[str, Any]) -> str | None:
    """'profile' or 'plan' from a document's `format` (`regen-<kind>/<version>`), None for anything else."""
    fmt = str(document.get("format", ""))
    for kind in ("profile", "plan"):
        if fmt.startswith(f"regen-{kind}/"):
            return kind
    return None


def check_format(document: dict[str, Any], path: str | Path, kind: str, supported_versions: tuple[int, ...]) -> None:
    """A FormatError unless `document` is a `kind` ("profile" or "plan") of a supported version."""
    fmt = str(document["format"])
    prefix = f"regen-{kind}/"
    if not fmt.startswith(prefix):
        raise FormatError(f"{path}: format is '{fmt}', expected a regen {kind} ('{prefix}N')")
    try:
        version = int(fmt[len(prefix):])
    except ValueError:
        raise FormatError(f"{path}: unreadable format version in '{fmt}'") from None
    if version not in supported_versions:
        known = ", ".join(f"{prefix}{v}" for v in supported_versions)
        raise FormatError(
            f"{path}: format '{fmt}' is not supported by this regen (it reads {known}); "
            f"regenerate the file with this version of regen or upgrade regen"
        )


def load_document(path: str | Path, kind: str, supported_versions: tuple[int, ...]) -> dict[str, Any]:
    """Read a YAML document of `kind` ("profile" or "plan") and check its format version."""
    document = read_document(path, kind)
    check_format(document, path, kind, supported_versions)
    return document


def require(mapping: dict[str, Any], key: str, where: str) -> Any:
    """`mapping[key]`, or a FormatError naming the missing field and where it was expected."""
    if not isinstance(mapping, dict):
        raise FormatError(f"{where}: expected a mapping, found {type(mapping).__name__}")
    if key not in mapping:
        raise FormatError(f"{where}: missing field '{key}'")
    return mapping[key]


def required(mapping: dict[str, Any], key: str, hint: Any, where: str) -> Any:
    """`mapping[key]` checked as a field of type `hint` (`checked_value`); missing, a FormatError."""
    return checked_value(require(mapping, key, where), hint, key, f"{where}: {key}")


def optional(mapping: dict[str, Any], key: str, hint: Any, where: str, default: Any = None) -> Any:
    """`mapping[key]` checked as a field of type `hint`, or `default` when it is absent or null."""
    value = mapping.get(key)
    return default if value is None else checked_value(value, hint, key, f"{where}: {key}")


def build_dataclass(cls, data: Any, where: str):
    """Construct dataclass `cls` from a mapping, with FormatErrors that say what is wrong.

    Unknown keys are ignored (a newer writer may add fields within a format version); missing
    required fields are an error naming the field, and so is a value of the wrong type or out of range
    (`checked_value`): a file that loads holds what its types say.
    """
    if not isinstance(data, dict):
        raise FormatError(f"{where}: expected a mapping, found {type(data).__name__}")
    hints = _field_types(cls)
    kwargs = {}
    for f in fields(cls):
        if f.name in data:
            kwargs[f.name] = checked_value(data[f.name], hints[f.name], f.name, f"{where}: {f.name}")
        elif f.default is MISSING and f.default_factory is MISSING:
            raise FormatError(f"{where}: missing field '{f.name}'")
    return cls(**kwargs)


@functools.cache
def _field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# NOTE [ Field ranges by unit ]
# A field's name carries its unit (docs: "units in names"), and the unit says what range it has: a
# count of bytes (`bytes`, `*_bytes`), a duration or a rate (`*_s`, `*_per_s`) is never negative, and
# no number in a file is NaN or infinite. Fields outside these rules are checked by their dataclass's
# loader (an op index within the profile, an action among ACTIONS).
NON_NEGATIVE_SUFFIXES = ("bytes", "_s", "_per_s")


def checked_value(value: Any, hint: Any, name: str, where: str) -> Any:
    """`value` as field `name` of type `hint` holds it (an int where a float is expected becomes a
    float), or a FormatError naming the field: a wrong type, a NaN or infinity, a negative count of
    bytes or seconds. Nested dataclasses and untyped fields pass unchecked (their loaders build them)."""
    if value is None:
        if _allows_none(hint):
            return None
        raise FormatError(f"{where}: must be {_type_name(hint)}, found nothing (null)")
    hint = _without_none(hint)
    origin = typing.get_origin(hint)
    if origin is list:
        if not isinstance(value, list):
            raise FormatError(f"{where}: must be a list, found {type(value).__name__} {value!r:.40}")
        (item,) = typing.get_args(hint) or (Any,)
        return [checked_value(v, item, name, f"{where}[{k}]") for k, v in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise FormatError(f"{where}: must be true or false, found {value!r:.40}")
        return value
    if hint is int or hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (hint is int and isinstance(value, float)):
            raise FormatError(f"{where}: must be {_type_name(hint)}, found {type(value).__name__} {value!r:.40}")
        if not math.isfinite(value):
            raise FormatError(f"{where}: must be a finite number, found {value}")
        if name.endswith(NON_NEGATIVE_SUFFIXES) and value < 0:
            raise FormatError(f"{where}: must not be negative, found {value}")
        return float(value) if hint is float else value
    if hint is str:
        if not isinstance(value, str):
            raise FormatError(f"{where}: must be text, found {type(value).__name__} {value!r:.40}")
        return value
    return value  # a nested dataclass, a mapping, Any: checked where it is built


def _allows_none(hint: Any) -> bool:
    return hint is Any or type(None) in typing.get_args(hint)


def _without_none(hint: Any) -> Any:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else Any
    return hint


def _type_name(hint: Any) -> str:
    hint = _without_none(hint)
    return {int: "an integer", float: "a number", str: "text", bool: "true or false"}.get(
        hint, "a list" if typing.get_origin(hint) is list else getattr(hint, "__name__", str(hint)))
