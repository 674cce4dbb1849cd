"""The bounded JSON reader (`ntp_nemo.data.bounded_json`) takes time linear in its input whatever the input
holds: the shapes that made the old depth check quadratic (an unterminated string of escaped quotes: 160 KB
took 192 s) and the other adversarial shapes are refused or parsed at once, and the depth it reports is
the one a character-by-character reading gives."""

from __future__ import annotations

import json
import random
import time

import pytest

from ntp_nemo.data.bounded_json import JSONBoundError, JSONInputError, nesting_depth, parse_json, read_json

MB = 1 << 20


def _depth_by_hand(text: str) -> int:
    """The oracle: a plain reading, one character at a time (inside a string, a backslash takes the next
    character with it)."""
    depth = deepest = 0
    inside = escaped = False
    for ch in text:
        if inside:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                inside = False
        elif ch == '"':
            inside = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _value(rng: random.Random, level: int = 0):
    if level > 7 or rng.random() < 0.3:
        return rng.choice([0, -1.5e300, "", "plain", 'a"b', "x]}\"{", "\\", "\\\\\"]", "é[ü", "\\" * 7 + '"[',
                           None, True])
    if rng.random() < 0.5:
        return [_value(rng, level + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}[\"\\{{": _value(rng, level + 1) for i in range(rng.randint(0, 3))}


def test_the_depth_is_the_one_a_plain_reading_gives():
    rng = random.Random(7)
    for _ in range(2000):
        text = json.dumps(_value(rng), ensure_ascii=rng.random() < 0.5)
        assert nesting_depth(text) == _depth_by_hand(text), text
        assert nesting_depth(text.encode()) == _depth_by_hand(text), text


ADVERSARIAL = {
    # name: (10 MB of text, what the reader must answer: None = parsed, else the error class)
    "unterminated string of escaped quotes": ('"\\' * (5 * MB), JSONInputError),
    "quotes only": ('"' * (10 * MB), JSONInputError),
    "backslashes only": ("\\" * (10 * MB), JSONInputError),
    "a string of escaped quotes": ('["' + '\\"' * (5 * MB - 2) + '"]', None),
    "unclosed arrays": ("[" * (10 * MB), JSONBoundError),
    "closed arrays 10 million deep": ("[" * (5 * MB) + "]" * (5 * MB), JSONBoundError),
    "a million empty arrays": ("[" + "[]," * (3 * MB) + "[]]", None),
    "a long integer": ("1" * (10 * MB), JSONInputError),
    "a long fraction": ("0." + "1" * (10 * MB), None),
    "brackets inside an unterminated string": ('"' + "[" * (10 * MB), JSONInputError),
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_each_adversarial_shape_of_ten_megabytes_is_answered_at_once(name, tmp_path):
    """The bound here is what a user is promised (no crafted file keeps a command busy): the quadratic
    check took 192 s on 160 KB; a linear one takes well under a second on this machine for 10 MB, and
    15 s leaves room for a loaded CI machine while still failing on anything quadratic."""
    text, expected = ADVERSARIAL[name]
    path = tmp_path / "input.json"
    path.write_text(text)
    start = time.monotonic()
    if expected is None:
        read_json(path, max_bytes=16 * MB)
    else:
        with pytest.raises(expected) as err:
            read_json(path, max_bytes=16 * MB)
        message = str(err.value)
        assert "\n" not in message and len(message) < 300, message
    assert time.monotonic() - start < 15


def test_a_deep_file_is_refused_naming_the_depth_and_the_bound():
    with pytest.raises(JSONBoundError, match="65 levels deep, more than the 64 allowed"):
        parse_json("[" * 65 + "]" * 65)
    deepest = parse_json("[" * 64 + "]" * 64)
    for _ in range(63):
        deepest = deepest[0]
    assert deepest == []
