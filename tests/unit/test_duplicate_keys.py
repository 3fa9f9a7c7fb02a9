"""gateway.body_guard.duplicate_key_path: a JSON body whose object holds one key twice is found, at any depth,
with the key's path (pure; hypothesis writes the bodies).

Reported: ``{"model": "a", "model": "b"}`` was accepted and Python kept the last value, while a proxy or WAF
in front that keeps the first judged another request (a request-smuggling class).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.body_guard import duplicate_key_path, repeated_query_parameter

KEYS = st.text(st.characters(codec="utf-8"), max_size=12)
LEAVES = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
TREES = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=30,
)


def _objects(tree: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every object of ``tree`` with its path (the format duplicate_key_path answers in), document order."""
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(tree, dict):
        found.append((path, tree))
        for key, value in tree.items():
            found.extend(_objects(value, f"{path}.{key}" if path else key))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            found.extend(_objects(value, f"{path}[{i}]"))
    return found


def _dumped(tree: Any, target: dict[str, Any] | None, repeat: str, escape: bool) -> str:
    """``tree`` as JSON, with ``repeat`` written a second time at the end of object ``target`` (``escape``: the
    second time with every character as a ``\\uXXXX`` escape, as a WAF may not decode)."""
    if isinstance(tree, dict):
        pairs = [f"{json.dumps(k)}:{_dumped(v, target, repeat, escape)}" for k, v in tree.items()]
        if tree is target:
            spelled = json.dumps(repeat, ensure_ascii=True)
            if escape:
                spelled = '"' + "".join(f"\\u{u:04x}" for u in _utf16(repeat)) + '"'
            pairs.append(f"{spelled}:0")
        return "{" + ",".join(pairs) + "}"
    if isinstance(tree, list):
        return "[" + ",".join(_dumped(v, target, repeat, escape) for v in tree) + "]"
    return json.dumps(tree)


def _utf16(text: str) -> list[int]:
    raw = text.encode("utf-16-be")
    return [int.from_bytes(raw[i : i + 2], "big") for i in range(0, len(raw), 2)]


@given(TREES)
def test_a_body_without_repeated_keys_passes(tree: Any) -> None:
    assert duplicate_key_path(json.dumps(tree).encode()) is None


@given(TREES, st.data(), st.booleans())
def test_a_key_written_twice_in_any_object_is_found_with_its_path(tree: Any, data: st.DataObject, escape: bool) -> None:
    objects = [(path, obj) for path, obj in _objects(tree) if obj]
    if not objects:
        tree = {"k": tree}
        objects = [("", tree)]
    path, target = data.draw(st.sampled_from(objects))
    repeat = data.draw(st.sampled_from(sorted(target)))
    body = _dumped(tree, target, repeat, escape).encode()
    assert json.loads(body) is not None  # still JSON: only the repeat is wrong
    assert duplicate_key_path(body) == (f"{path}.{repeat}" if path else repeat)


@pytest.mark.parametrize(
    ("body", "path"),
    [
        (b'{"model": "a", "model": "b"}', "model"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x", "role": "system"}]}', "messages[0].role"),
        (b'[{"model": "a"}, {"x": 1}, {"model": "a", "y": {"k": 1, "k": 1}}]', "[2].y.k"),
        (b'{"m\\u006fdel": "a", "model": "b"}', "model"),  # an escape is the same key to Python
        (b'{"a": {"b": 1, "b": 2}, "a": 3}', "a"),  # the outer repeat drops the inner object: still found
        (b'{"input": [[1, 2], {"text": "t", "text": "u"}]}', "input[1].text"),
    ],
)
def test_examples(body: bytes, path: str) -> None:
    assert duplicate_key_path(body) == path


def test_a_long_key_is_cut_in_the_path() -> None:
    key = "k" * 1000
    assert duplicate_key_path(json.dumps({"a": [{key: 1}]}).encode()[:-3] + f',"{key}":2}}]}}'.encode()) == (
        "a[0]." + "k" * 100
    )


@pytest.mark.parametrize("body", [b'{"a": 1, "a": ', b"\xff{}", b"", b"[" * 5, b'{"a": 1} {"a": 1, "a": 2}'])
def test_a_body_that_is_not_json_is_left_to_the_route(body: bytes) -> None:
    assert duplicate_key_path(body) is None


@pytest.mark.parametrize(
    ("query", "repeated"),
    [
        (b"", None),
        (b"wait_s=1", None),
        (b"wait_s=1&limit=2&after=x", None),
        (b"wait_s=1&wait_s=600", "wait_s"),
        (b"wait_s=1&wait%5Fs=600", "wait_s"),  # decoded as Starlette decodes it
        (b"a=1&b&b=2", "b"),  # a bare name is a parameter too (keep_blank_values)
        (b"x" * 300 + b"=1&" + b"x" * 300 + b"=2", "x" * 100),  # named, cut to 100 characters
    ],
)
def test_a_repeated_query_parameter_is_named(query: bytes, repeated: str | None) -> None:
    assert repeated_query_parameter(query) == repeated
