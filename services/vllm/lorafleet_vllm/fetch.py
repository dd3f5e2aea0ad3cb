"""`python -m lorafleet_vllm.fetch`: download BASE_MODEL into the Hugging Face cache, then exit.

The stack's one-shot `model-fetch` service runs it with egress, so that the replicas can run on an
internal network with HF_HUB_OFFLINE=1: they read the model from the shared cache and never reach
the internet. A base model given as a local directory needs nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lorafleet.settings import ConfigError, ReplicaSettings, load_settings


def main() -> int:
    try:
        settings = load_settings(ReplicaSettings)
    except ConfigError as exc:
        print(f"model-fetch: {exc}", file=sys.stderr)
        return 2
    if Path(settings.base_model).is_dir():
        print(f"model-fetch: {settings.base_model} is a local directory: nothing to download")
        return 0
    from huggingface_hub import snapshot_download

    print(f"model-fetch: {settings.base_model} is in the cache at {snapshot_download(settings.base_model)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
