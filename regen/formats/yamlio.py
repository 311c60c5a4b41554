"""Reading and writing versioned YAML documents (profiles and plans).

Uses PyYAML's C loader and dumper when libyaml is present (a profile of a few thousand ops then loads
in well under a second), and the pure-Python ones otherwise. Every document carries a `format` key of
the form `regen-<kind>/<version>`; a reader refuses another kind or an unknown version with a message
that names the file, what it found and what it expected.
"""

from __future__ import annotations

import os
from pathlib import Path
from dataclasses import MISSING, fields
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


def dump_document(document: dict[str, Any], path: str | Path) -> None:
    """Write `document` as YAML to `path`, atomically: a crash or a write error never leaves half a file
    or a temporary file behind."""
    path = check_output_path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            yaml.dump(document, f, Dumper=_Dumper, sort_keys=False, default_flow_style=None, width=120)
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise FormatError(f"{path}: cannot write ({exc.strerror or exc})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_document(path: str | Path, kind: str = "file") -> dict[str, Any]:
    """Parse the YAML document at `path`: a mapping with a `format` key, whatever its kind."""
    path = Path(path)
    if not path.exists():
        raise FormatError(f"{path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            document = yaml.load(f, Loader=_Loader)
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())  # one line: the CLI prints errors on a single line
        raise FormatError(f"{path}: not valid YAML ({detail})") from None
    except UnicodeDecodeError:
        raise FormatError(f"{path}: not a text file") from None
    if not isinstance(document, dict) or "format" not in document:
        raise FormatError(f"{path}: not a regen {kind} (no 'format' key at the top)")
    return document


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


def build_dataclass(cls, data: Any, where: str):
    """Construct dataclass `cls` from a mapping, with FormatErrors that say what is wrong.

    Unknown keys are ignored (a newer writer may add fields within a format version); missing
    required fields are an error naming the field.
    """
    if not isinstance(data, dict):
        raise FormatError(f"{where}: expected a mapping, found {type(data).__name__}")
    kwargs = {}
    for f in fields(cls):
        if f.name in data:
            kwargs[f.name] = data[f.name]
        elif f.default is MISSING and f.default_factory is MISSING:
            raise FormatError(f"{where}: missing field '{f.name}'")
    return cls(**kwargs)
