"""The annotation codec: both generations written, either read."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sharegpu.core import names
from sharegpu.core.annotations import Allocation, assigned_patch, decode, encode, is_assigned
from sharegpu.core.errors import ValidationError


def test_encode_writes_both_generations():
    a = Allocation(mem={0: {1: 1}, 1: {1: 7}}, core={0: {1: 10}, 1: {1: 20}})
    ann = encode(a, assume_time_ns=123, gpu_capacity={0: 15, 1: 15})
    assert ann[names.ANN_ALLOCATION] == '{"0":{"1":1},"1":{"1":7}}'
    assert ann[names.ANN_CORE] == '{"0":{"1":10},"1":{"1":20}}'
    assert ann[names.ANN_MEM_IDX] == "1"
    assert ann[names.ANN_MEM_POD] == "8"
    assert ann[names.ANN_MEM_DEV] == "15"
    assert ann[names.ANN_MEM_ASSIGNED] == ann[names.ANN_ASSIGNED] == "false"
    assert ann[names.ANN_MEM_ASSUME_TIME] == ann[names.ANN_ASSUME_TIME] == "123"


def test_no_core_annotation_without_compute():
    ann = encode(Allocation(mem={0: {0: 3}}), assume_time_ns=1)
    assert names.ANN_CORE not in ann


def test_decode_second_generation_only():
    a = decode({names.ANN_ALLOCATION: '{"0":{"2":4,"3":4}}'})
    assert a == Allocation(mem={0: {2: 4, 3: 4}})


def test_decode_first_generation_only():
    a = decode({names.ANN_MEM_IDX: "1", names.ANN_MEM_POD: "3"})
    assert a == Allocation(mem={0: {1: 3}})
    a = decode({names.ANN_MEM_IDX: "0,2", names.ANN_MEM_POD: "8"})
    assert a == Allocation(mem={0: {0: 4, 2: 4}})


def test_second_generation_wins():
    a = decode({names.ANN_MEM_IDX: "0", names.ANN_MEM_POD: "3",
                names.ANN_ALLOCATION: '{"0":{"1":3}}'})
    assert a is not None and a.gpus == (1,)


def test_nothing_recorded():
    assert decode({}) is None
    assert decode({"other": "x"}) is None


@pytest.mark.parametrize("raw", ["not json", "[]", '{"0": 3}', '{"0":{"x":1}}', '{"0":{"1":-1}}'])
def test_malformed_second_generation(raw):
    with pytest.raises(ValidationError) as e:
        decode({names.ANN_ALLOCATION: raw})
    assert str(e.value).startswith(f"annotation {names.ANN_ALLOCATION}={raw!r}: must be JSON")


def test_malformed_first_generation():
    with pytest.raises(ValidationError) as e:
        decode({names.ANN_MEM_IDX: "a", names.ANN_MEM_POD: "3"})
    assert "must be GPU indices" in str(e.value)
    with pytest.raises(ValidationError) as e:
        decode({names.ANN_MEM_IDX: "0,1", names.ANN_MEM_POD: "3"})
    assert "divisible by the number of GPUs" in str(e.value)


def test_assigned():
    assert not is_assigned(encode(Allocation(mem={0: {0: 1}}), assume_time_ns=1))
    assert is_assigned(assigned_patch())
    assert is_assigned({names.ANN_MEM_ASSIGNED: "true"})


per_container = st.dictionaries(
    st.integers(0, 4), st.dictionaries(st.integers(0, 15), st.integers(1, 80), min_size=1,
                                       max_size=4), min_size=1, max_size=3,
)


@given(per_container, st.integers(0, 2**62))
def test_round_trip(mem, t):
    core = {c: {g: 5 for g in gs} for c, gs in mem.items()}
    a = Allocation(mem=mem, core=core)
    ann = encode(a, assume_time_ns=t)
    json.loads(ann[names.ANN_ALLOCATION])
    assert decode(ann) == a
    # the first generation alone keeps the per-GPU totals
    first = {k: v for k, v in ann.items() if k.startswith("ALIYUN_COM_GPU_MEM")}
    if len(set(a.per_gpu_mem().values())) == 1:
        assert decode(first).per_gpu_mem() == a.per_gpu_mem()


FIRST_GEN_PLACEMENT = (names.ANN_MEM_IDX, names.ANN_MEM_POD, names.ANN_MEM_DEV)


@pytest.mark.parametrize("mem", [
    {0: {0: 4}, 1: {1: 2}},  # 4+2 on two GPUs: an even split would read back 3+3
    {0: {0: 3}, 1: {1: 2}},  # 3+2: a total of 5 over two GPUs is refused
    {0: {0: 4, 1: 4}, 1: {1: 2}},  # GPU 0 holds 4, GPU 1 holds 6
])
def test_mixed_per_gpu_amounts_round_trip_through_either_generation(mem):
    """What encode writes reads back as the same GPUs and amounts, from both generations
    together and from the first generation alone (as ACK's older tools write and read it):
    the first generation, one GPU list and a pod total split evenly, cannot say unequal
    amounts, so for such a pod it is not written, rather than written wrong."""
    a = Allocation(mem=mem)
    ann = encode(a, assume_time_ns=5, gpu_capacity={0: 16, 1: 16})
    both = decode(ann)
    assert both is not None and both.per_gpu_mem() == a.per_gpu_mem()
    first = {k: v for k, v in ann.items() if k.startswith("ALIYUN_COM_GPU_MEM")}
    if any(k in first for k in FIRST_GEN_PLACEMENT):
        alone = decode(first)
        assert alone is not None and alone.per_gpu_mem() == a.per_gpu_mem()
    assert ann[names.ANN_MEM_ASSIGNED] == "false" and ann[names.ANN_MEM_ASSUME_TIME] == "5"


@given(st.dictionaries(st.integers(0, 3), st.dictionaries(st.integers(0, 7), st.integers(1, 80),
                                                          min_size=1, max_size=4),
                       min_size=1, max_size=3))
def test_any_allocation_reads_back_from_what_encode_writes(mem):
    a = Allocation(mem=mem)
    ann = encode(a, assume_time_ns=1)
    assert decode(ann).per_gpu_mem() == a.per_gpu_mem()
    first = {k: v for k, v in ann.items() if k.startswith("ALIYUN_COM_GPU_MEM")}
    if names.ANN_MEM_IDX in first:
        assert decode(first).per_gpu_mem() == a.per_gpu_mem()
    else:  # only where the first generation cannot say it
        assert len(set(a.per_gpu_mem().values())) > 1
