"""lorafleet.safetensors_header against the safetensors library itself: for every file hypothesis makes (real files
the library wrote, then cut, grown or with a byte changed; and headers put together at random), the check refuses
exactly the files `safetensors.deserialize` refuses, which is the parser vLLM's loader uses."""

from __future__ import annotations

import json
import os
import struct
import tempfile

import pytest
import safetensors
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lorafleet.safetensors_header import DTYPE_BITS, header_problem
from safetensors.torch import save

pytestmark = pytest.mark.timeout(120)

TORCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64)
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3)
tensors = st.dictionaries(st.text("abcdefgh._", min_size=1, max_size=12),
                          st.tuples(st.sampled_from(TORCH_DTYPES), shapes), min_size=1, max_size=4)


def library_accepts(data: bytes) -> bool:
    try:
        safetensors.deserialize(data)
    except safetensors.SafetensorError:
        return False
    return True


def check(data: bytes) -> str | None:
    with tempfile.NamedTemporaryFile() as handle:
        handle.write(data)
        handle.flush()
        fd = os.open(handle.name, os.O_RDONLY)
        try:
            return header_problem(fd)
        finally:
            os.close(fd)


def agrees(data: bytes) -> None:
    problem = check(data)
    assert (problem is None) == library_accepts(data), problem


def written(spec: dict[str, tuple[torch.dtype, list[int]]]) -> bytes:
    return save({name: torch.zeros(shape, dtype=dtype) for name, (dtype, shape) in spec.items()})


@settings(max_examples=150, deadline=None)
@given(tensors, st.data())
def test_a_written_file_passes_and_every_cut_growth_or_changed_byte_is_judged_as_the_library_judges_it(spec, data):
    original = written(spec)
    agrees(original)
    assert check(original) is None
    cut = data.draw(st.integers(0, len(original) - 1))
    agrees(original[:cut])
    agrees(original + data.draw(st.binary(min_size=1, max_size=64)))
    at = data.draw(st.integers(0, len(original) - 1))
    agrees(original[:at] + bytes([data.draw(st.integers(0, 255))]) + original[at + 1:])
    agrees(original[::-1])


entries = st.fixed_dictionaries({
    "dtype": st.sampled_from([*DTYPE_BITS, "F33"]),
    "shape": st.lists(st.integers(0, 4), max_size=3),
    "data_offsets": st.lists(st.integers(0, 64), min_size=2, max_size=2),
})


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text("abc", min_size=1, max_size=3), entries, max_size=3), st.integers(0, 80),
       st.one_of(st.none(), st.dictionaries(st.text("m", min_size=1), st.text(max_size=3), max_size=2)))
def test_headers_put_together_at_random_are_judged_as_the_library_judges_them(header, data_bytes, metadata):
    if metadata is not None:
        header = {**header, "__metadata__": metadata}
    text = json.dumps(header).encode()
    agrees(struct.pack("<Q", len(text)) + text + bytes(data_bytes))


def test_the_refusal_names_what_is_wrong():
    original = written({"w": (torch.float32, [2, 2])})
    assert "too small" in (check(original[:4]) or "")
    assert "header claims" in (check(struct.pack("<Q", 10**9) + original[8:]) or "")
    assert "not JSON" in (check(original[:8] + original[8:][::-1]) or "")
    assert "cover" in (check(original + b"\0") or "")
