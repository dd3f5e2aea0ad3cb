"""A safetensors file checked the way vLLM's loader will read it, before any replica is asked to load it.

vLLM answers a load whose weights file it cannot parse (truncated, grown, rewritten) with 500 InternalServerError, so
a tenant's broken file would come back from the fleet as a server error. The proxy reads every adapter file anyway
when it copies it into its content store; it checks the copy's header with the rules of the safetensors format and
refuses a broken one with a 400 that names the file, before a replica is touched.

The format (the safetensors project's README, "Format"): 8 bytes, a little-endian unsigned header size N; N bytes of
UTF-8 JSON, an object mapping each tensor's name to {"dtype", "shape", "data_offsets": [begin, end]} plus an optional
"__metadata__" of strings; then the data. The reader refuses a header larger than 100,000,000 bytes or past the end of
the file, offsets that do not tile the data from 0 without gap or overlap, a tensor whose byte length is not its
dtype's size times its element count, and data not fully covered by the tensors. Its own `deserialize` needs the
whole file in memory and `safe_open` needs numpy, which the proxy's image does not carry; the unit test holds this
check to `safetensors.deserialize`'s verdict on every mutation it generates.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any, NamedTuple

MAX_HEADER_BYTES = 100_000_000  # the safetensors reader's own limit
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
              "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64,
              "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


class HeaderError(ValueError):
    """A safetensors file whose header cannot be read: too small, a size past its end, not a JSON object."""


class Header(NamedTuple):
    """A safetensors file's header and where its data lies (from `data_start`, `data_bytes` long)."""

    entries: dict[str, Any]  # tensor name -> {"dtype", "shape", "data_offsets"}, and "__metadata__" where present
    data_start: int
    data_bytes: int


def read_header(fd: int) -> Header:
    """The header of the safetensors file open at `fd`, read alone (no tensor is read); HeaderError says why not.
    The one reader of the format's header: the store's check, the attestation's module names and the trainer's
    tensor comparison."""
    size = os.fstat(fd).st_size
    if size < 8:
        raise HeaderError(f"{size} bytes: too small for a header")
    (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise HeaderError(f"its header claims {length} bytes, the file holds {size}")
    try:
        entries = json.loads(os.pread(fd, length, 8).decode("utf-8"))
    except ValueError:  # UnicodeDecodeError included
        raise HeaderError("its header is not JSON") from None
    if not isinstance(entries, dict):
        raise HeaderError("its header is not a JSON object")
    return Header(entries, 8 + length, size - 8 - length)


def header_problem(fd: int) -> str | None:
    """Why the safetensors file open at `fd` cannot be read as one (None: it can). Reads the header only."""
    try:
        header = read_header(fd)
    except HeaderError as error:
        return str(error)
    return _tensors_problem(header.entries, header.data_bytes)


def _tensors_problem(header: dict[str, Any], data_bytes: int) -> str | None:
    """Whether the header's tensors tile `data_bytes` of data exactly, each as long as its dtype and shape say."""
    spans = []
    for name, spec in header.items():
        if name == "__metadata__":
            if spec is not None and (not isinstance(spec, dict) or not all(isinstance(v, str) for v in spec.values())):
                return "its __metadata__ is not a mapping of strings"
            continue
        if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= set(spec):
            return f"tensor {name!r} is not described by dtype, shape and data_offsets"
        dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        if dtype not in DTYPE_BITS:
            return f"tensor {name!r} has an unknown dtype {dtype!r}"
        if not _naturals(shape) or not _naturals(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
            return f"tensor {name!r} has a malformed shape or data_offsets"
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
            return f"tensor {name!r} spans {offsets[1] - offsets[0]} bytes, its dtype and shape need {bits / 8:g}"
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            return f"tensor {name!r} starts at byte {begin} of the data, not at {end}"
        end = stop
    if end != data_bytes:
        return f"its tensors cover {end} bytes of data, the file holds {data_bytes}"
    return None


def _naturals(values: Any) -> bool:
    return isinstance(values, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)
