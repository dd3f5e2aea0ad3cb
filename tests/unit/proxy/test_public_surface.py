"""The proxy's public surface stays what clients rely on: the OpenAPI document and the metric names.

`surface.json` beside this file is the surface as released (routes with their methods, parameters, bodies and
documented answers; every metric family with its type and labels). A refactor that changes one of them fails
here; a deliberate change regenerates the file (`python tests/unit/proxy/test_public_surface.py`) and says so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from lorafleet.settings import StackSettings
from lorafleet_proxy.app import create_app

SNAPSHOT = Path(__file__).with_name("surface.json")


def surface(tmp: Path) -> dict[str, Any]:
    settings = StackSettings(adapter_root=tmp, proxy_upstreams="http://127.0.0.1:9")
    app = create_app(settings)
    metrics = {family.name: {"type": family.type, "documentation": family.documentation,
                             "labels": sorted({key for sample in family.samples for key in sample.labels})}
               for family in app.state.metrics.registry.collect()}
    return {"openapi": app.openapi(), "metrics": dict(sorted(metrics.items()))}


def test_openapi_document_and_metric_names_are_unchanged(tmp_path: Path) -> None:
    released = json.loads(SNAPSHOT.read_text())
    now = json.loads(json.dumps(surface(tmp_path)))
    assert sorted(now["openapi"]["paths"]) == sorted(released["openapi"]["paths"])
    assert now["openapi"] == released["openapi"]
    assert now["metrics"] == released["metrics"]


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        SNAPSHOT.write_text(json.dumps(surface(Path(folder)), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}", file=sys.stderr)
