"""Two safetensors files compared tensor by tensor as bytes: no torch import (the start's checks stay light).

The format: an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and byte range,
then the data. Equal bytes under the same dtype and shape are equal tensors; metadata and key order do not count.
"""

from __future__ import annotations

import os
from pathlib import Path

from lorafleet.safetensors_header import read_header

METADATA = "__metadata__"


def _tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Each tensor of the file at `path`: its dtype, shape and bytes (lorafleet.safetensors_header reads the header)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        header = read_header(fd)
        body = os.pread(fd, header.data_bytes, header.data_start)
    finally:
        os.close(fd)
    return {name: (entry["dtype"], tuple(entry["shape"]), body[entry["data_offsets"][0]:entry["data_offsets"][1]])
            for name, entry in header.entries.items() if name != METADATA}


def same_tensors(first: Path, second: Path) -> bool:
    """True when both files hold the same tensor names with the same dtype, shape and bytes."""
    return _tensors(first) == _tensors(second)
