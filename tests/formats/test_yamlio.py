"""Profiles written as JSON text: YAML readers read the same document, and regen reads it without YAML."""

import json

import pytest
import yaml

import regen.formats.yamlio as yamlio
from regen.formats import load_profile, save_profile
from regen.formats.yamlio import dump_document, json_text, read_document

from tests.formats.test_formats import tiny_profile

TRICKY = {
    "format": "regen-profile/2",
    "floats": [1e-05, -2e-10, 1e20, 1.5e-07, 0.1, 3.0, 123456789012345678.0, 0.0, -0.0],
    "ints": [0, -1, 2**62, 7],
    "text": ["1e-05, 2e+20", "a \"quoted\" \\ back", "café", "line\nbreak\ttab", "", "null", "true", "0x1F", "~"],
    "nested": {"empty": [], "none": None, "flags": [True, False], "deep": [{"k": [1, 2.5e-08]}]},
    "empty": [],
    "rows": [{"index": 0, "time_s": 1e-05}, {"index": 1, "time_s": 2.5e-06, "module": "blocks.3.mlp"}],
}
YAML_LOADERS = [yaml.SafeLoader] + ([yaml.CSafeLoader] if hasattr(yaml, "CSafeLoader") else [])


@pytest.mark.parametrize("loader", YAML_LOADERS, ids=lambda loader: loader.__name__)
def test_json_text_reads_alike_as_json_and_as_yaml(loader):
    text = json_text(TRICKY)
    assert text is not None and text.startswith("{")
    assert json.loads(text) == TRICKY
    assert yaml.load(text, Loader=loader) == TRICKY
    assert "1.0e-05" in text and "1e-05, 2e+20" in text  # numbers get a dot before the exponent, text does not
    assert text.count("\n") >= len(TRICKY) + len(TRICKY["rows"]) + len(TRICKY["floats"])  # an item a line


@pytest.mark.parametrize("document", [
    {"format": "x", "time_s": float("nan")},
    {"format": "x", "time_s": float("inf")},
    {"format": "x", "name": "emoji \U0001F600"},  # a surrogate pair in JSON, two characters to YAML
    {"format": "x", "args": {1: "one"}},  # JSON would turn the key into "1"
])
def test_what_json_cannot_carry_alike_is_written_as_yaml(tmp_path, document):
    assert json_text(document) is None
    dump_document(document, tmp_path / "d.yaml", as_json=True)
    with pytest.raises(ValueError):
        json.loads((tmp_path / "d.yaml").read_text())  # YAML, not JSON
    back = read_document(tmp_path / "d.yaml")
    assert repr(back) == repr(document)  # repr: NaN is not equal to itself


def test_a_profile_is_written_as_json_and_read_without_yaml(tmp_path, monkeypatch):
    profile = tiny_profile()
    save_profile(profile, tmp_path / "p.profile.yaml")
    assert (tmp_path / "p.profile.yaml").read_text().startswith('{"format": "regen-profile/2"')

    def no_yaml(*args, **kwargs):
        raise AssertionError("a profile written as JSON was parsed as YAML")

    monkeypatch.setattr(yamlio.yaml, "load", no_yaml)
    assert load_profile(tmp_path / "p.profile.yaml") == profile


def test_a_profile_in_yaml_block_style_still_loads(tmp_path):
    """Profiles written before JSON text (and hand-written ones) are YAML's block style."""
    profile = tiny_profile()
    dump_document(profile.to_dict(), tmp_path / "old.profile.yaml")
    assert (tmp_path / "old.profile.yaml").read_text().startswith("format: regen-profile/2")
    assert load_profile(tmp_path / "old.profile.yaml") == profile


def test_a_path_that_cannot_be_read_is_one_format_error(tmp_path):
    from regen.errors import FormatError

    (tmp_path / "a.profile.yaml").mkdir()
    with pytest.raises(FormatError, match="cannot read"):
        load_profile(tmp_path / "a.profile.yaml")
