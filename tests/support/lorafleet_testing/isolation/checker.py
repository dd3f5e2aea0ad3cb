"""The isolation checker: judges an attack folder from its artifacts alone, never from the harness's memory.

It reads `victims.json` (each victim's names, fingerprint and file digests, and the adversary's own), `attempts.jsonl`
(every answer the adversary got), `observations.jsonl` (what every replica listed, with the digests of each listed
folder's files when it was seen), `victim_loads.jsonl`, the proxy's ledger file and the content store folders it
names, and proves:

- `victim-bytes`: no folder a replica listed, and no ledger entry, under the adversary's run holds a file whose digest
  is a victim's (or a victim's fingerprint);
- `refusal-named`: every 4xx the adversary got is a vLLM-style body whose message names the path, the name or the
  setting it refused;
- `victim-undisturbed`: every victim load answered 200, and every replica listed each victim name with the victim's
  own files whenever it was seen, and the ledger holds each victim's fingerprint at the end.

Answers that are neither 2xx nor 4xx (a replica overloaded) are counted, not judged: they refuse nothing.
"""

from __future__ import annotations

import json
import posixpath
from collections import Counter
from pathlib import Path
from typing import Any

from lorafleet.runs import run_of

from lorafleet_testing.isolation.adversary import digests

REASONS = {  # a refusal's reason, from its message
    "not a plain folder": "symlink or file in the path",
    "cannot be opened as a plain file": "a symlink or socket as a file",
    "not a regular file": "FIFO, device or socket",
    "hard links": "hard link",
    "is empty": "empty file",
    "PROXY_ADAPTER_MAX_MB": "over PROXY_ADAPTER_MAX_MB",
    "changed while it was copied": "changed during the copy",
    "not a readable safetensors file": "not a safetensors file",
    "no weights file": "no weights file",
    "outside the folder of": "outside the run's folder",
    "outside the adapter root": "outside the adapter root",
    "proxy's own folders": "the proxy's own folders",
    "invalid adapter name": "another run's adapter name",
    "No adapter found": "no adapter there",
}


OUTCOMES = ("loaded", "refused", "server_error", "skipped")


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def reason(message: str) -> str:
    return next((why for key, why in REASONS.items() if key in message), "other: " + message[:80])


def names_it(record: dict[str, Any], message: str) -> bool:
    """The refusal names what it refused: the path as sent (or its last name), the adapter name, or a setting."""
    sent = record["path"]
    last = posixpath.basename(posixpath.normpath(sent)) if sent else ""
    return any(part and part in message for part in (sent, last, record["name"], "PROXY_ADAPTER_MAX_MB"))


def check(folder: Path) -> dict[str, Any]:
    """The verdict on the attack in `folder`: counts and violations (none: isolation held)."""
    victims = json.loads((folder / "victims.json").read_text())
    adversary, own = victims["adversary"], set(victims["adversary_files"].values())
    theirs = {digest for victim in victims["victims"].values() for digest in victim["files"].values()} - own
    prints = {victim["fingerprint"] for victim in victims["victims"].values()}
    violations: list[dict[str, Any]] = []
    attempts = lines(folder / "attempts.jsonl")
    by_trick: dict[str, Counter[str]] = {}
    refusals: Counter[str] = Counter()
    for record in attempts:
        outcome = by_trick.setdefault(record["trick"], Counter(dict.fromkeys(OUTCOMES, 0)))
        if "skipped" in record:
            outcome["skipped"] += 1
            continue
        status = record["status"]
        outcome["loaded" if status < 300 else "refused" if 400 <= status < 500 else "server_error"] += 1
        if 400 <= status < 500:
            error = _error(record["body"])
            message = str(error.get("message", ""))
            refusals[reason(message)] += 1
            if not message or error.get("code") != status or not names_it(record, message):
                violations.append({"invariant": "refusal-named", "attempt": record["attempt"],
                                   "trick": record["trick"], "detail": record["body"][:300]})
    for row in lines(folder / "observations.jsonl"):
        run = run_of(row["name"])[0]
        leaked = set(row["files"].values()) & theirs
        if run == adversary and leaked:
            violations.append({"invariant": "victim-bytes", "attempt": row["attempt"], "replica": row["replica"],
                               "detail": f"{row['name']} at {row['root']} holds a victim's file"})
        victim = victims["victims"].get(run)
        if victim and row["name"] == victim["name"] and row["files"] != victim["files"]:
            violations.append({"invariant": "victim-undisturbed", "attempt": row["attempt"],
                               "replica": row["replica"], "detail": f"{row['name']} at {row['root']} is not its files"})
    violations += _ledger(folder, victims, adversary, theirs, prints)
    for load in lines(folder / "victim_loads.jsonl"):
        if load["status"] != 200:
            violations.append({"invariant": "victim-undisturbed", "attempt": load["attempt"],
                               "detail": f"{load['run']}'s load answered {load['status']}: {load['body'][:200]}"})
    return {"attempts": sum(1 for record in attempts if "skipped" not in record),
            "skipped": sum(1 for record in attempts if "skipped" in record),
            "by_trick": {trick: dict(counts) for trick, counts in sorted(by_trick.items())},
            "refusals_by_reason": dict(refusals.most_common()),
            "observations": len(lines(folder / "observations.jsonl")),
            "victim_loads": len(lines(folder / "victim_loads.jsonl")),
            "violation_count": len(violations), "violations": violations}


def _ledger(folder: Path, victims: dict[str, Any], adversary: str, theirs: set[str],
            prints: set[str]) -> list[dict[str, Any]]:
    ledger = json.loads((folder / "ledger.json").read_text()) if (folder / "ledger.json").exists() else {}
    entries = {entry["name"]: entry for entry in ledger.get("adapters", [])}
    found = []
    for name, entry in entries.items():
        if entry["run"] == adversary and (entry["fingerprint"] in prints or set(digests(entry["path"]).values())
                                          & theirs):
            found.append({"invariant": "victim-bytes", "attempt": None, "detail": f"ledger entry {name}: {entry}"})
    for run, victim in victims["victims"].items():
        entry = entries.get(victim["name"])
        if entry is None or entry["fingerprint"] != victim["fingerprint"]:
            found.append({"invariant": "victim-undisturbed", "attempt": None,
                          "detail": f"the ledger's entry for {run}'s {victim['name']} at the end: {entry}"})
    return found


def _error(body: str) -> dict[str, Any]:
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return {}
    return error if isinstance(error, dict) else {}
