"""Kubernetes quantities parsed as the API server parses them, and GPU counts through them."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import limits, pod
from sharegpu.core import quantity
from sharegpu.core.errors import ValidationError
from sharegpu.core.request import parse_pod


@pytest.mark.parametrize(("text", "value"), [
    ("4", 4), ("+4", 4), ("-4", -4), ("4.0", 4), ("4.", 4), (".5", Fraction(1, 2)),
    ("500m", Fraction(1, 2)), ("4000m", 4), ("1k", 1000), ("1Ki", 1024), ("2Gi", 2 << 30),
    ("1e3", 1000), ("1E3", 1000), ("1e-3", Fraction(1, 1000)), ("100n", Fraction(1, 10**7)),
    ("9223372036854775807", (1 << 63) - 1), (4, 4), (2.0, 2),
])
def test_the_grammar(text, value):
    assert quantity.parse("q", text) == value


@pytest.mark.parametrize("text", [
    "²", "٤", "４", "1.5.2", "Gi", "", " ", "\n", "4 4", "4\x1c", "4\u200b", "0x10", "1e", "4GB", "4gi", "1e3.5", "--4",
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
        assert text.strip(quantity.SPACE).isascii()


@pytest.mark.parametrize("text", ["4\n", " 4", "4 ", "\t4\r\n", "4\u00a0", "\u30004\u2029",
                                  "\v4Gi\f"])
def test_whitespace_around_a_quantity_is_dropped_as_the_api_server_drops_it(text):
    """The API server's decoders parse strings.TrimSpace of the value (Go's unicode.IsSpace);
    its CBOR decoder, like this module, of the decoded string (tests/e2e shows JSON's)."""
    assert quantity.parse("q", text) == (4 << 30 if "Gi" in text else 4)


@pytest.mark.parametrize("text", ["4\n", " 4 ", "+4\t"])
def test_a_gpu_request_with_whitespace_around_it_is_that_number(text):
    """The webhook, the extender and the simulator read requests through parse_pod: one
    answer for all of them."""
    from sharegpu.webhook import review

    p = pod("p", [limits(mem=text, core=text.replace("4", "50"))], labels={
        "aliyun.com/gpu-count": "1"})
    r = parse_pod(p)
    assert (r.containers[0].gpu_mem, r.containers[0].gpu_core) == (4, 50)
    out = review({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                  "request": {"uid": "u", "operation": "CREATE", "object": p}})
    assert out["response"]["allowed"] is True, out
