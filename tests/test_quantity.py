"""Kubernetes quantities parsed as the API server parses them, and GPU counts through them."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import limits, pod
from sharegpu import quantity
from sharegpu.errors import ValidationError
from sharegpu.request import parse_pod


@pytest.mark.parametrize(("text", "value"), [
    ("4", 4), ("+4", 4), ("-4", -4), ("4.0", 4), ("4.", 4), (".5", Fraction(1, 2)),
    ("500m", Fraction(1, 2)), ("4000m", 4), ("1k", 1000), ("1Ki", 1024), ("2Gi", 2 << 30),
    ("1e3", 1000), ("1E3", 1000), ("1e-3", Fraction(1, 1000)), ("100n", Fraction(1, 10**7)),
    ("9223372036854775807", (1 << 63) - 1), (4, 4), (2.0, 2),
])
def test_the_grammar(text, value):
    assert quantity.parse("q", text) == value


@pytest.mark.parametrize("text", [
    "²", "٤", "４", "1.5.2", "Gi", "", " 4", "4 ", "0x10", "1e", "4GB", "4gi", "1e3.5", "--4",
    "4" * 100, "9223372036854775808", float("nan"), True, None, [], {},
])
def test_not_quantities(text):
    with pytest.raises(ValidationError) as e:
        quantity.parse("q", text)
    assert e.value.field == "q"


def test_named_reproducers_of_the_fuzzing_campaign():
    """``str.isdigit`` took "²" (then int() crashed) and the Arabic-Indic "٤" (as 4 GiB)."""
    for bad in ("²", "٤", "9" * 5000):
        p = pod("p", [limits(mem=bad)])
        with pytest.raises(ValidationError) as e:
            parse_pod(p)
        assert 'aliyun.com/gpu-mem"]' in e.value.field
        assert "whole number of GiB" in e.value.rule
    with pytest.raises(ValidationError, match="largest quantity"):
        parse_pod(pod("p", [limits(mem=10**20)]))


@settings(max_examples=500, deadline=None, derandomize=True)
@given(st.text(max_size=30))
def test_any_text_is_a_value_or_a_clear_refusal(text):
    try:
        q = quantity.parse("limits.x", text)
    except ValidationError as e:
        assert e.field == "limits.x" and e.rule
    else:
        assert isinstance(q, Fraction) and abs(q) <= quantity.MAX
        assert text.isascii()
