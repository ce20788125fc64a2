"""Reading the user's records: every field memfit reads is text, or the run stops with one line naming it."""

from __future__ import annotations

import json

import pytest

from memfit.data import DataError, load_pairs
from tests.conftest import write_jsonl


def _pairs(compose_cfg, path):
    return load_pairs(compose_cfg("model=tiny_seq2seq", "data=jsonl", f"data.path={path}").data, "seq2seq")


@pytest.mark.parametrize(
    ("bad", "line"),
    [
        (
            {"source": "a b", "target": ["budget", "with", "words"]},
            "field 'target' is a list, not text: join its parts",
        ),
        ({"source": 12, "target": "a"}, "field 'source' is a number, not text: write it as a string"),
        ({"source": "a", "target": {"text": "b"}}, "field 'target' is an object, not text"),
        ({"source": "a", "target": True}, "field 'target' is a boolean, not text"),
    ],
)
def test_a_field_that_is_not_text_is_one_line_naming_record_field_and_type(compose_cfg, tmp_path, bad, line):
    rows = [{"source": "a b c", "target": "d e"}] * 3 + [bad]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    with pytest.raises(DataError) as err:
        _pairs(compose_cfg, path)
    assert str(err.value).startswith(f"data.path={path} record 4 {line}")


def test_a_line_that_is_not_an_object_is_one_line(compose_cfg, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"source": "a", "target": "b"}) + "\n" + json.dumps(["a", "b"]) + "\n")
    with pytest.raises(DataError, match=r"record 2 is a list, not an object of fields: write one JSON object"):
        _pairs(compose_cfg, path)


def test_text_fields_and_an_absent_source_read_as_before(compose_cfg, tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [{"target": "only a target"}, {"source": "s", "target": "t"}])
    assert _pairs(compose_cfg, path)["train"] == [
        {"source": "", "target": "only a target"},
        {"source": "s", "target": "t"},
    ]
