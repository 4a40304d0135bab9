"""Shared validators: messages name the value and the constraint."""

import math

import pytest

from fewbit_design.errors import (
    FewBitError,
    check_bits,
    check_boolean,
    check_choice,
    check_integer,
    check_keys,
    check_number,
    check_positive,
    check_range,
    check_string,
    close_matches,
    parse_int_spec,
)


def test_check_choice_lists_valid_choices():
    with pytest.raises(FewBitError, match=r"mode must be 'levelsets' or 'intervals', got 'foo'"):
        check_choice("mode", "foo", ["levelsets", "intervals"])
    assert check_choice("mode", "intervals", ["levelsets", "intervals"]) == "intervals"


@pytest.mark.parametrize("bits", [0, 9, 2.5, "3", True, None])
def test_check_bits_rejects(bits):
    with pytest.raises(FewBitError, match="bits must be an integer from 1 to 8"):
        check_bits(bits)


def test_check_bits_accepts_integral_values():
    assert check_bits(3) == 3 and check_bits(8.0) == 8


def test_check_range_and_positive():
    assert check_range(-1, 2) == (-1.0, 2.0)
    with pytest.raises(FewBitError, match="A < B, got A=3, B=1"):
        check_range(3, 1)
    with pytest.raises(FewBitError, match="finite"):
        check_range(float("nan"), 1)
    with pytest.raises(FewBitError, match="scale must be > 0, got -1"):
        check_positive("scale", -1)


def test_close_matches():
    assert close_matches("gelo", ["gelu", "selu", "relu6", "tanh"])[0] == "gelu"


@pytest.mark.parametrize(
    "text, expected", [("3", [3]), ("1-4", [1, 2, 3, 4]), ("1,3,4", [1, 3, 4]), ("4,1-2", [1, 2, 4])]
)
def test_parse_int_spec(text, expected):
    assert parse_int_spec(text) == expected


@pytest.mark.parametrize("text", ["0-9", "0", "9", "x", "3-1", "1-", ""])
def test_parse_int_spec_rejects(text):
    with pytest.raises(FewBitError):
        parse_int_spec(text)


@pytest.mark.parametrize(
    ("check", "value", "message"),
    [
        (lambda v: check_integer("start", v, low=0), -1, "start must be an integer >= 0, got -1"),
        (lambda v: check_integer("start", v, low=0), 2.0, "start must be an integer >= 0, got 2.0"),
        (lambda v: check_integer("start", v, low=0), True, "got True"),
        (lambda v: check_integer("bits", v, low=1, high=8), "3", "bits must be an integer from 1 to 8, got '3'"),
        pytest.param(lambda v: check_integer("n", v, high=0), 10**5000, "an integer of 16610 bits", id="huge"),
        (lambda v: check_number("seconds", v, low=0), float("inf"), "seconds must be a finite number"),
        (lambda v: check_number("seconds", v, low=0), "1.5", "seconds must be a number >= 0, got '1.5'"),
        (lambda v: check_boolean("checkpoint", v), "no", "checkpoint must be true or false, got 'no'"),
        (lambda v: check_boolean("checkpoint", v), 0, "got 0"),
        (lambda v: check_string("name", v), 3, "name must be a string, got 3"),
        (lambda v: check_keys("segment", v, ("start",), ("children",)), {"stop": 1}, "segment lacks 'start'"),
        (lambda v: check_keys("segment", v, ("start",)), {"start": 1, "x": 2}, "unknown field 'x'"),
        (lambda v: check_keys("segment", v, ("start",)), [1], r"segment must be an object \(a dict\), got \[1\]"),
    ],
)
def test_strict_json_validators(check, value, message):
    with pytest.raises(FewBitError, match=message):
        check(value)


def test_strict_json_validators_accept():
    assert check_integer("n", 3, low=0, high=3) == 3 and check_number("t", 2, low=0) == 2.0
    assert check_boolean("flag", False) is False and check_keys("d", {"a": 1}, ("a",), ("b",)) == {"a": 1}
    assert math.isnan(check_number("t", float("nan"), allow_nan=True))
