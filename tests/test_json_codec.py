"""tokenway/json_codec.py reads and writes what the standard library does, fast or not."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenway.json_codec import dumps, dumps_ascii, loads

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_what_it_writes_the_standard_library_reads_back_as_it_was(value):
    assert json.loads(dumps(value)) == value
    text = dumps_ascii(value)
    assert text.isascii()
    assert json.loads(text) == value


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_it_reads_what_the_standard_library_writes(value):
    assert loads(json.dumps(value)) == value
    assert loads(json.dumps(value, ensure_ascii=False).encode()) == value


def test_compact_and_utf8_like_json_dumps():
    value = {"a": [1, 2.5, None, True], "b": "héllo ✓", "c": {"d": ""}}
    assert dumps(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    assert dumps_ascii(value) == json.dumps(value, separators=(",", ":"))


@pytest.mark.parametrize("value", [
    {"n": 2**70},                 # past 64 bits
    {1: "int key", None: "none key", 2.5: "float key"},
    {True: "bool key", False: "another"},
])
def test_what_orjson_refuses_is_written_as_json_writes_it(value):
    assert dumps(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    assert dumps_ascii(value) == json.dumps(value, separators=(",", ":"))


def test_a_lone_surrogate_is_escaped_in_ascii_and_refused_in_utf8_as_before():
    assert dumps_ascii({"s": "\ud800"}) == '{"s":"\\ud800"}'
    with pytest.raises(UnicodeEncodeError):  # as json.dumps(...).encode() raised
        dumps({"s": "\ud800"})


@pytest.mark.parametrize("text", ['{"n": 123456789012345678901234567890}', '[-9223372036854775809]',
                                  '[18446744073709551616, 1.5]', '{"x": NaN}', '[Infinity, -Infinity]',
                                  '"\\ud800"', '{"a": 1e400}'])
def test_what_orjson_refuses_to_read_is_read_as_json_reads_it(text):
    got, want = loads(text), json.loads(text)
    assert repr(got) == repr(want)  # NaN too: repr compares what == cannot


@pytest.mark.parametrize("text", ['{"a": }', "[1, 2", "", "nul", '{"a": 1}}', "\ufeff{}", '{"a": "x\ty"}', "[1,]",
                                  "[.5]", '{"a": 01}', "[1]\x00"])
def test_what_neither_reads_is_the_standard_librarys_error(text):
    with pytest.raises(json.JSONDecodeError) as got:
        loads(text)
    with pytest.raises(json.JSONDecodeError) as want:
        json.loads(text)
    assert (got.value.msg, got.value.pos) == (want.value.msg, want.value.pos)


def test_a_document_nested_past_the_interpreter_is_a_recursion_error_as_before():
    with pytest.raises(RecursionError):
        loads("[" * 100_000 + "]" * 100_000)
