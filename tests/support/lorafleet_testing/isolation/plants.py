"""Planted defects: each puts back one way the proxy once was (or could be) wrong, by monkeypatching the product in
the process the harness runs the proxy in (LORAFLEET_PLANT names one), never by a branch in product code. The
harness must catch each, and catch it again from the same seed:

- `double-resolution`: the path is resolved again (symlinks followed) between the route's check and the walk, as the
  broadcast's second `confine()` did before issue 64;
- `no-nofollow`: the walk opens folders and files without O_NOFOLLOW;
- `reuse-unverified`: a store folder already present is reused without its hash check.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import lorafleet_proxy.content_store as content_store
from lorafleet.adapters import confine
from lorafleet_proxy.content_store import ContentStore, Stored

PLANTS = ("double-resolution", "no-nofollow", "reuse-unverified")


def put_back(plant: str | None) -> Callable[[], None]:
    """Apply `plant` (None: none); returns what undoes it."""
    if plant is None:
        return lambda: None
    if plant == "double-resolution":
        original = ContentStore.ingest

        def resolved_again(self: ContentStore, path: str | os.PathLike[str]) -> Stored:
            return original(self, os.path.realpath(self.adapter_root / confine(path, self.adapter_root)))

        ContentStore.ingest = resolved_again  # type: ignore[method-assign]
        return lambda: setattr(ContentStore, "ingest", original)
    if plant == "no-nofollow":
        content_store.NOFOLLOW = 0
        return lambda: setattr(content_store, "NOFOLLOW", os.O_NOFOLLOW)
    if plant == "reuse-unverified":
        verify = ContentStore._verify_locked
        ContentStore._verify_locked = lambda self, digest: True  # type: ignore[method-assign]
        return lambda: setattr(ContentStore, "_verify_locked", verify)
    raise ValueError(f"unknown plant {plant!r}: one of {', '.join(PLANTS)}")
