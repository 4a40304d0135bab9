"""Shared validators: messages name the value and the constraint."""

import pytest

from fewbit_design.errors import (
    FewBitError,
    check_bits,
    check_choice,
    check_positive,
    check_range,
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
