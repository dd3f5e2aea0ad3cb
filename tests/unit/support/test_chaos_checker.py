"""The chaos checker over synthetic artifacts: a run killed at random steps and resumed the way the trainer resumes
leaves artifacts that pass every invariant; each planted defect (issue 56.7's step past MAX_STEPS and orphaned
version among them) is reported under its invariant with its first bad record, the seed and the schedule."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from lorafleet.adapters import LORA_DIR_NAME, METRICS_FILE, policy_name
from lorafleet.runs import qualify
from lorafleet_testing.chaos.judge import (
    ADAPTERS,
    INVARIANTS,
    MANIFEST,
    OBSERVED,
    TAIL_LINES,
    Report,
    check_folder,
    render,
)
from lorafleet_trainer.prompt_log import PROMPTS_FILE, effective
from lorafleet_trainer.provenance import ROLLOUTS_FILE
from lorafleet_trainer.resume import rollback_bound

GENERATIONS = 8
REPLICAS = ("http://127.0.0.1:1", "http://127.0.0.1:2")
PIDS = {url: 100 + index for index, url in enumerate(REPLICAS)}  # one process each for the whole run
EPOCH = 1_800_000_000.0  # the synthetic runs' clock: start k begins at EPOCH + 1000 k


def stamped(at: float, text: str) -> str:
    """A trainer log line at time `at`, stamped as lorafleet.logs stamps it."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at * 1000) % 1000:03d}Z INFO {text}"


@dataclass(frozen=True)
class Plan:
    """A run's settings and its kills: each start trains `advance` steps past its checkpoint, then is SIGKILLed;
    `cut` = the kill came while the checkpoint of that step was written (the start before it is resumed)."""

    max_steps: int
    save_steps: int
    groups: int  # prompt groups one step consumes
    max_staleness: int
    kills: list[tuple[int, bool]]
    rows: int = 5
    stale_every: int = 0  # every this many steps one more group is dropped as stale (0: never), as in chaos runs


@dataclass
class Run:
    """The artifacts of one synthetic run, as the trainer would leave them."""

    plan: Plan
    lines: list[dict[str, Any]] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    published: list[int] = field(default_factory=list)
    checkpoints: set[int] = field(default_factory=set)
    shift: int = 0  # planted: the final start's stream starts this far off its checkpoint's head
    exits: list[int] = field(default_factory=list)

    def start(self, attempt: int, at: int, steps: int, final: bool) -> None:
        plan = self.plan
        bound = rollback_bound(plan.save_steps, plan.groups * GENERATIONS, GENERATIONS)
        began = EPOCH + 1000 * attempt  # its attempt: after its event=resuming line, before its prompt_stream
        if at:
            self.log.append(stamped(began - 1, f"event=resuming checkpoint=checkpoint-{at} step={at}"))
        self.log.append(stamped(began + 2, f"event=prompt_stream resume_at={self.first_position(at + 1)} skip=0 "
                                           f"rows={plan.rows} rollback_groups_max={bound}"))
        self.exits.append(-9)
        version = max(self.published, default=0) + 1
        self.published.append(version)  # the cold sync
        offset = self.shift if final else 0
        consumed = {p for line in effective(self.lines) if line["step"] <= at for p in line["positions"]}
        for step in range(at + 1, at + steps + 1):
            stale = 1 if plan.stale_every and step % plan.stale_every == 0 else 0  # dropped first, then trained
            positions = [self.first_position(step) + g + offset for g in range(stale + plan.groups)]
            consumed.update(positions)
            head = next(p for p in range(len(consumed) + 1) if p not in consumed)  # as the trainer counts it
            self.lines.append({"step": step, "attempt": began, "policy_version": version, "positions": positions,
                               "prompts": [p % plan.rows for p in positions],
                               "dropped": [p for p in positions[:stale] for _ in range(GENERATIONS)], "next": head})
            version += 1
            self.published.append(version)
            if step % plan.save_steps == 0 or step == plan.max_steps:
                self.checkpoints.add(step)

    def first_position(self, step: int) -> int:
        """The stream position of `step`'s first group: the groups of the steps before it, their stale drops too."""
        stale = (step - 1) // self.plan.stale_every if self.plan.stale_every else 0
        return (step - 1) * self.plan.groups + stale

    def train(self) -> None:
        at = 0
        for attempt, (advance, cut) in enumerate(self.plan.kills):
            reached = min(at + advance, self.plan.max_steps - 1)
            self.start(attempt, at, reached - at, final=False)
            resumed = reached - reached % self.plan.save_steps
            if cut and reached % self.plan.save_steps == 0 and reached:
                resumed = reached - self.plan.save_steps  # checkpoint-<reached> never completed
            at = max(resumed, at)
        self.start(len(self.plan.kills), at, self.plan.max_steps - at, final=True)
        self.log.append(f"event=finished steps={self.plan.max_steps}")
        self.exits[-1] = 0

    def window(self) -> list[int]:
        return self.published[-(self.plan.max_staleness + 2):]


def plans() -> st.SearchStrategy[Plan]:
    return st.builds(Plan, max_steps=st.integers(2, 14), save_steps=st.integers(1, 4), groups=st.integers(1, 4),
                     max_staleness=st.integers(1, 4),
                     kills=st.lists(st.tuples(st.integers(1, 6), st.booleans()), max_size=4),
                     stale_every=st.integers(0, 3))


def write(folder: Path, runs: dict[str, Run], seed: int = 7, final_ledger: dict[str, str] | None = None) -> Path:
    """The chaos folder of `runs`: manifest, each run's folder and log, the fleet as sampled at each publish (every
    replica holding the ledger), and each step's rollouts, answered while their version was held."""
    spec: dict[str, Any] = {}
    samples: list[dict[str, Any]] = []
    ledger: dict[str, str] = {}
    clock = iter(range(10**6))
    for name, run in runs.items():
        plan = run.plan
        run_folder = folder / ADAPTERS / "runs" / name
        lora = run_folder / LORA_DIR_NAME
        lora.mkdir(parents=True)
        (run_folder / PROMPTS_FILE).write_text("".join(json.dumps(line) + "\n" for line in run.lines))
        (run_folder / METRICS_FILE).write_text("".join(
            json.dumps({"step": line["step"], "ratio": 1.0 + 0.001 * (line["step"] % 3)}) + "\n"
            for line in run.lines))
        for step in run.checkpoints:
            (run_folder / f"checkpoint-{step}").mkdir()
        for version in run.window():
            (lora / policy_name(version)).mkdir()
        (folder / f"{name}.log").write_text("\n".join(run.log) + "\n")
        spec[name] = {"max_steps": plan.max_steps, "max_staleness": plan.max_staleness, "exit_code": 0,
                      "log": f"{name}.log", "rows": plan.rows, "exits": run.exits}
        published_at: dict[int, float] = {}
        for version in run.published:
            ledger[qualify(name, policy_name(version))] = f"sha256:{name}-{version}"
            published_at[version] = next(clock)
            samples.append({"time": published_at[version], "ledger": dict(ledger), "replicas": {},
                            "held": {url: sorted(ledger) for url in REPLICAS},
                            "listed_at": dict.fromkeys(REPLICAS, published_at[version]), "pids": dict(PIDS)})
        (run_folder / ROLLOUTS_FILE).write_text("".join(json.dumps(rollout(name, line, position, published_at)) + "\n"
                                                        for line in run.lines for position in line["positions"]))
        stale = {qualify(name, policy_name(v)) for v in run.published if v not in run.window()}
        ledger = {key: value for key, value in ledger.items() if key not in stale}
    final = ledger if final_ledger is None else final_ledger
    end = next(clock)
    samples.append({"time": end, "ledger": final, "replicas": {url: sorted(ledger) for url in REPLICAS},
                    "held": {url: sorted(ledger) for url in REPLICAS}, "listed_at": dict.fromkeys(REPLICAS, end),
                    "pids": dict(PIDS)})
    (folder / OBSERVED).write_text("".join(json.dumps(sample) + "\n" for sample in samples))
    schedule = [{"at_step": 1.5, "kind": "sigkill", "target": "trainer-a", "hold_s": 0.0, "phase": "training"}]
    (folder / MANIFEST).write_text(json.dumps({"seed": seed, "schedule": schedule, "runs": spec}))
    return folder


def rollout(run: str, line: dict[str, Any], position: int, published_at: dict[int, float]) -> dict[str, Any]:
    """A sample of `position` generated with the line's version, logged half a sample after its publish."""
    version = line["policy_version"]
    answer = {"replica": REPLICAS[position % len(REPLICAS)], "adapter": qualify(run, policy_name(version)),
              "fingerprint": f"sha256:{run}-{version}", "tokens": 4}
    return {"time": published_at[version] + 0.5, "group": position, "version": version, "tokens": 4,
            "answers": [answer], "key": "0"}


def trained(plan: Plan, shift: int = 0) -> Run:
    run = Run(plan, shift=shift)
    run.train()
    return run


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(a=plans(), b=plans())
def test_runs_killed_and_resumed_by_the_contract_pass_every_invariant(tmp_path_factory, a: Plan, b: Plan) -> None:
    report = check_folder(write(tmp_path_factory.mktemp("chaos"), {"a": trained(a), "b": trained(b)}))
    assert report.ok, render(report)
    assert report.checked == list(INVARIANTS)
    assert "invariants hold" in render(report)


def _violated(folder: Path, invariant: str) -> Any:
    report = check_folder(folder)
    violation = report.first(invariant)
    assert violation is not None, render(report)
    text = render(report)
    assert "seed=7" in text and "make chaos SEED=7" in text and '"kind": "sigkill"' in text
    assert f"VIOLATION {invariant}" in text and "first bad record" in text
    if violation.run:  # and the end of that run's log, where it stood (or, short at the deadline, its stacks)
        tail = report.tails[violation.run]
        assert f"the end of run {violation.run}'s trainer log ({len(tail)} lines)" in text
        assert all(f"  {line}" in text for line in tail) and len(tail) <= TAIL_LINES
    return violation.record


@SETTINGS
@given(plan=plans())
def test_a_start_past_max_steps_is_caught_at_its_first_line(tmp_path_factory, plan: Plan) -> None:
    """Issue 56.7: killed after checkpoint-<MAX_STEPS> was complete, a start trained step MAX_STEPS + 1."""
    run = trained(plan)
    run.start(attempt=99, at=plan.max_steps, steps=1, final=False)
    run.log.append(f"event=finished steps={plan.max_steps + 1}")
    record = _violated(write(tmp_path_factory.mktemp("chaos"), {"a": run}), "no_step_past_max")
    assert record["step"] == plan.max_steps + 1 and record["attempt"] == EPOCH + 99_000


@SETTINGS
@given(plan=plans())
def test_a_version_orphaned_by_a_killed_start_is_caught(tmp_path_factory, plan: Plan) -> None:
    """Issue 56.7: a version a killed start published stays behind beside TRL's window."""
    run = trained(plan)
    orphan = run.window()[0] - 1
    assume(orphan >= 1)
    folder = write(tmp_path_factory.mktemp("chaos"), {"a": run})
    (folder / ADAPTERS / "runs" / "a" / LORA_DIR_NAME / policy_name(orphan)).mkdir()
    assert _violated(folder, "version_window") == [orphan, *run.window()]


@SETTINGS
@given(plan=plans())
def test_a_resume_before_its_checkpoints_head_is_caught(tmp_path_factory, plan: Plan) -> None:
    """A resume that consumes a group again (its consumed_above ignored, or its stream restarted a group early)
    breaks the contract at the final start's first line. (One that starts past the head is not seen: the trainer's
    head then stays at the group it jumped, and holes are judged below the head; docs/benchmarks/chaos.md.)"""
    run = trained(plan, shift=-1)
    first = next(line for line in run.lines if line["attempt"] == EPOCH + 1000 * len(plan.kills))
    assume(first["step"] > 1)
    assert _violated(write(tmp_path_factory.mktemp("chaos"), {"a": run}), "resume_contract") == first


def test_rolled_back_repeats_past_the_logged_bound_are_caught(tmp_path: Path) -> None:
    run = trained(Plan(max_steps=8, save_steps=2, groups=2, max_staleness=2, kills=[(3, False)]))
    run.log = [line.replace("rollback_groups_max=5", "rollback_groups_max=1") for line in run.log]
    record = _violated(write(tmp_path, {"a": run}), "resume_contract")
    assert record["step"] == 3 and record["attempt"] == EPOCH


def test_a_start_that_never_logged_its_bound_is_reported(tmp_path: Path) -> None:
    run = trained(Plan(max_steps=4, save_steps=2, groups=1, max_staleness=2, kills=[]))
    run.log = [line for line in run.log if "prompt_stream" not in line]
    assert _violated(write(tmp_path, {"a": run}), "resume_contract") is None


@pytest.mark.parametrize("exit_code", [1, 137, None])
def test_a_run_that_did_not_exit_0_is_caught(tmp_path: Path, exit_code: int | None) -> None:
    folder = write(tmp_path, {"a": trained(Plan(max_steps=4, save_steps=2, groups=1, max_staleness=2, kills=[]))})
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["runs"]["a"]["exit_code"] = exit_code
    (folder / MANIFEST).write_text(json.dumps(manifest))
    _violated(folder, "finished")


def test_a_run_short_of_max_steps_is_caught(tmp_path: Path) -> None:
    run = trained(Plan(max_steps=6, save_steps=2, groups=1, max_staleness=2, kills=[]))
    run.lines = run.lines[:-1]
    assert _violated(write(tmp_path, {"a": run}), "finished")["step"] == 5


def test_versions_going_back_are_caught(tmp_path: Path) -> None:
    run = trained(Plan(max_steps=6, save_steps=2, groups=1, max_staleness=2, kills=[(3, False)]))
    first_of_second_start = next(line for line in run.lines if line["attempt"] == EPOCH + 1000)
    first_of_second_start["policy_version"] = 1
    assert _violated(write(tmp_path, {"a": run}), "versions_go_up") == first_of_second_start


def test_a_name_loaded_with_two_contents_is_caught(tmp_path: Path) -> None:
    folder = write(tmp_path, {"a": trained(Plan(max_steps=4, save_steps=2, groups=1, max_staleness=2, kills=[]))})
    samples = [json.loads(line) for line in (folder / OBSERVED).read_text().splitlines()]
    name = qualify("a", policy_name(1))
    samples[0]["ledger"][name] = "sha256:other"
    (folder / OBSERVED).write_text("".join(json.dumps(sample) + "\n" for sample in samples))
    record = _violated(folder, "one_content_per_name")
    assert record["ledger"][name] == "sha256:a-1"


def test_a_name_first_loaded_below_an_earlier_one_is_caught(tmp_path: Path) -> None:
    folder = write(tmp_path, {"a": trained(Plan(max_steps=4, save_steps=2, groups=1, max_staleness=2, kills=[]))})
    samples = [json.loads(line) for line in (folder / OBSERVED).read_text().splitlines()]
    samples[-1]["ledger"][qualify("a", policy_name(1000))] = "sha256:x"
    samples[-1]["ledger"] = {**samples[-1]["ledger"], qualify("a", policy_name(999)): "sha256:y"}
    (folder / OBSERVED).write_text("".join(json.dumps(sample) + "\n" for sample in samples))
    assert "a--trl-policy-v999" in _violated(folder, "versions_go_up")["ledger"]


def test_a_ready_replica_unlike_the_ledger_at_the_end_is_caught(tmp_path: Path) -> None:
    """A replica that rejoined without catch-up: it lacks the newest version the ledger holds."""
    run = trained(Plan(max_steps=4, save_steps=2, groups=1, max_staleness=2, kills=[]))
    ledger = {qualify("a", policy_name(v)): f"sha256:a-{v}" for v in run.window()}
    ledger[qualify("a", policy_name(99))] = "sha256:a-99"
    record = _violated(write(tmp_path, {"a": run}, final_ledger=ledger), "ledger_equals_replicas")
    assert record["ledger"] == ledger


def test_a_replica_not_ready_at_the_end_is_not_compared(tmp_path: Path) -> None:
    folder = write(tmp_path, {"a": trained(Plan(max_steps=4, save_steps=2, groups=1, max_staleness=2, kills=[]))})
    samples = [json.loads(line) for line in (folder / OBSERVED).read_text().splitlines()]
    samples[-1]["replicas"][REPLICAS[0]] = None
    (folder / OBSERVED).write_text("".join(json.dumps(sample) + "\n" for sample in samples))
    assert check_folder(folder).ok


def test_an_importance_ratio_past_its_bound_is_caught(tmp_path: Path) -> None:
    folder = write(tmp_path, {"a": trained(Plan(max_steps=4, save_steps=2, groups=1, max_staleness=2, kills=[]))})
    metrics = folder / ADAPTERS / "runs" / "a" / METRICS_FILE
    metrics.write_text(metrics.read_text() + json.dumps({"step": 4, "ratio": 1.2}) + "\n")
    assert _violated(folder, "importance_ratio") == {"step": 4, "ratio": 1.2}


def _rewrite(path: Path, change: Any) -> list[dict[str, Any]]:
    """Apply `change` to the JSON lines of `path`, in place; the lines after it."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    change(lines)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return lines


@SETTINGS
@given(plan=plans(), pick=st.integers(0, 10**6))
def test_a_rollout_naming_a_content_the_ledger_never_held_is_caught(tmp_path_factory, plan: Plan, pick: int) -> None:
    folder = write(tmp_path_factory.mktemp("chaos"), {"a": trained(plan)})
    path = folder / ADAPTERS / "runs" / "a" / ROLLOUTS_FILE
    index = pick % len(path.read_text().splitlines())

    def plant(lines: list[dict[str, Any]]) -> None:
        lines[index]["answers"][0]["fingerprint"] = "sha256:another-content"

    lines = _rewrite(path, plant)
    assert _violated(folder, "provenance") == lines[index]


@SETTINGS
@given(plan=plans(), pick=st.integers(0, 10**6))
def test_a_rollout_from_a_replica_never_seen_holding_its_version_is_caught(tmp_path_factory, plan: Plan,
                                                                           pick: int) -> None:
    """A replica that answered for a version it had lost (restarted, never caught up): it never listed the name."""
    folder = write(tmp_path_factory.mktemp("chaos"), {"a": trained(plan)})
    path = folder / ADAPTERS / "runs" / "a" / ROLLOUTS_FILE
    rollouts = [json.loads(line) for line in path.read_text().splitlines()]
    bad = rollouts[pick % len(rollouts)]
    replica, name = bad["answers"][0]["replica"], bad["answers"][0]["adapter"]

    def forget(samples: list[dict[str, Any]]) -> None:
        for sample in samples:
            sample["held"][replica] = [held for held in sample["held"][replica] if held != name]

    _rewrite(folder / OBSERVED, forget)
    first = next(r for r in rollouts if r["answers"][0]["replica"] == replica and r["answers"][0]["adapter"] == name)
    assert _violated(folder, "provenance") == first


def test_a_replica_seen_holding_the_version_only_after_the_rollout_is_caught(tmp_path: Path) -> None:
    folder = write(tmp_path, {"a": trained(Plan(max_steps=4, save_steps=2, groups=1, max_staleness=2, kills=[]))})
    path = folder / ADAPTERS / "runs" / "a" / ROLLOUTS_FILE

    def early(lines: list[dict[str, Any]]) -> None:
        lines[-1]["time"] = -5.0  # logged before the first sample: nobody held anything yet

    lines = _rewrite(path, early)
    assert _violated(folder, "provenance") == lines[-1]


def _one_run(tmp_path: Path) -> tuple[Path, list[dict[str, Any]], list[dict[str, Any]]]:
    """A clean chaos folder of one run: the folder, its rollouts and its observed lines."""
    folder = write(tmp_path, {"a": trained(Plan(max_steps=6, save_steps=2, groups=1, max_staleness=1, kills=[]))})
    path = folder / ADAPTERS / "runs" / "a" / ROLLOUTS_FILE
    rollouts = [json.loads(line) for line in path.read_text().splitlines()]
    observed = [json.loads(line) for line in (folder / OBSERVED).read_text().splitlines()]
    return folder, rollouts, observed


def _lose_after(observed: list[dict[str, Any]], replica: str, name: str, when: float, **change: Any) -> None:
    """`replica` stops listing `name` from `when` on (and before, it never did), with `change` to those samples."""
    for sample in observed:
        sample["held"][replica] = [held for held in sample["held"][replica] if held != name]
        if sample["time"] > when:
            for key, value in change.items():
                sample[key][replica] = value


def test_a_listing_asked_before_the_rollout_is_not_the_look_after_it(tmp_path: Path) -> None:
    """A sample is stamped when it ends; a replica that timed out makes it end seconds after its first listing was
    asked. The look after a rollout is the first listing *asked* after it, whatever the sample's stamp."""
    folder, rollouts, observed = _one_run(tmp_path)
    last = rollouts[-1]
    replica, name = last["answers"][0]["replica"], last["answers"][0]["adapter"]
    earlier = [sample for sample in observed if sample["time"] <= last["time"]]
    later = observed[len(earlier):]  # these list the name
    skewed = {"time": last["time"] + 2.0, "ledger": earlier[-1]["ledger"], "replicas": {},
              "held": {url: list(earlier[-1]["held"][url]) for url in REPLICAS},
              "listed_at": dict.fromkeys(REPLICAS, last["time"] - 0.3), "pids": dict(PIDS)}
    for sample in [*earlier, skewed]:
        sample["held"][replica] = [held for held in sample["held"][replica] if held != name]

    def observe(asked: float) -> Report:
        skewed["listed_at"] = dict.fromkeys(REPLICAS, asked)
        (folder / OBSERVED).write_text("".join(json.dumps(line) + "\n" for line in [*earlier, skewed, *later]))
        return check_folder(folder)

    report = observe(last["time"] - 0.3)  # asked before the rollout: the next listing is the look after it
    assert report.ok and report.provenance.unverified == 0, render(report)
    report = observe(last["time"] + 0.3)  # asked after it: this listing decides, and lacks the name
    assert report.first("provenance") is not None and report.first("provenance").record == last


@pytest.mark.parametrize("silence", ["restarted", "unreachable", "retired"])
def test_a_replica_the_listings_cannot_decide_is_undecided_not_violated(tmp_path: Path, silence: str) -> None:
    """The replica answered under the name (vLLM answers only under a name it holds), but the listings never show
    it: a restart before the next look lost it, the replica was never reached again, or the name left the ledger
    before the next look. Counted as undecided, with one reason; with none of these it is a violation."""
    folder, rollouts, observed = _one_run(tmp_path)
    first = rollouts[0]
    replica, name = first["answers"][0]["replica"], first["answers"][0]["adapter"]
    when = first["time"]
    if silence == "restarted":
        _lose_after(observed, replica, name, when, pids=PIDS[replica] + 1000)
    elif silence == "unreachable":
        _lose_after(observed, replica, name, when, held=None)
    else:
        _lose_after(observed, replica, name, when)
        observed.append({"time": when + 0.1, "ledger": {}})  # the watch: the ledger dropped every name
        observed.sort(key=lambda line: line["time"])
    (folder / OBSERVED).write_text("".join(json.dumps(line) + "\n" for line in observed))
    report = check_folder(folder)
    assert report.first("provenance") is None, render(report)
    assert report.provenance.unverified >= 1 and report.provenance.answers == sum(len(r["answers"]) for r in rollouts)
    reason = {"restarted": "restarted", "unreachable": "not reached again", "retired": "left the ledger"}[silence]
    assert reason in report.provenance.example and "undecided" in render(report)
    # The same silence with the replica's process, reach and ledger unchanged decides it: a violation.
    folder2, _, observed2 = _one_run(tmp_path / "plain")
    _lose_after(observed2, replica, name, when)
    (folder2 / OBSERVED).write_text("".join(json.dumps(line) + "\n" for line in observed2))
    assert check_folder(folder2).first("provenance") is not None


def test_a_version_seen_only_by_the_ledger_watch_is_held(tmp_path: Path) -> None:
    """A version that lived in the ledger between two fleet samples: the watch's line shows it, so its rollouts'
    fingerprints are the ledger's."""
    folder, rollouts, observed = _one_run(tmp_path)
    last = rollouts[-1]["answers"][0]
    fleet = [line for line in observed if "replicas" in line]
    for sample in fleet[:-1]:
        sample["ledger"].pop(last["adapter"], None)
    watch = {"time": rollouts[-1]["time"] - 0.2, "ledger": {last["adapter"]: last["fingerprint"]}}
    (folder / OBSERVED).write_text("".join(json.dumps(line) + "\n" for line in [*fleet[:-1], watch, fleet[-1]]))
    report = check_folder(folder)
    assert report.first("provenance") is None, render(report)
    (folder / OBSERVED).write_text("".join(json.dumps(line) + "\n" for line in [*fleet[:-1], fleet[-1]]))
    fleet[-1]["ledger"].pop(last["adapter"], None)
    (folder / OBSERVED).write_text("".join(json.dumps(line) + "\n" for line in fleet))
    assert "never held" in check_folder(folder).first("provenance").reason


def test_provenance_is_not_judged_without_the_fleets_history(tmp_path: Path) -> None:
    """A chaos folder without observed samples (a test that did not observe the fleet) is judged on the rest."""
    folder = write(tmp_path, {"a": trained(Plan(max_steps=4, save_steps=2, groups=1, max_staleness=2, kills=[]))})
    (folder / OBSERVED).unlink()
    report = check_folder(folder)
    assert report.ok and "provenance" not in report.checked and "errors_retried" in report.checked


PROMISED = [
    "rollout waiting for the fleet: ClientConnectorError: Cannot connect to host 127.0.0.1:1 ssl:default "
    "[Connect call failed ('127.0.0.1', 1)]; 0s of TRAINER_FLEET_WAIT_S=600, retry in 1.0s",
    "rollout waiting for the fleet: ServerDisconnectedError: Server disconnected; 3s of TRAINER_FLEET_WAIT_S=600, "
    "retry in 2.0s",
    "rollout waiting for the fleet: ClientResponseError: 503, message='Service Unavailable', url='x'; 0s of "
    "TRAINER_FLEET_WAIT_S=600, retry in 1.0s",
    "rollout waiting for the fleet: ClientResponseError: 429, message='Too Many Requests', url='x'; 0s of "
    "TRAINER_FLEET_WAIT_S=600, retry in 1.0s",
    "rollout waiting for the fleet: TimeoutError: ; 5s of TRAINER_FLEET_WAIT_S=600, retry in 4.0s",
    'event=control_call_waiting call="POST /runs/a/v1/load_lora_adapter" cause="NewConnectionError: refused" '
    'attempt=1 retry_in_s=0.5 reason="waiting for the fleet, up to TRAINER_FLEET_WAIT_S"',
    "event=control_call_waiting call=\"POST /runs/a/v1/load_lora_adapter\" cause=\"ProtocolError: ('Connection "
    "aborted.', ConnectionResetError(104, 'Connection reset by peer'))\" attempt=1",
    'event=control_call_waiting call="POST /pause" cause="HTTP 503" attempt=2 retry_in_s=1.0',
    'event=refused reason="refusing to start: /x has 0.01 GB free, under TRAINER_MIN_FREE_GB=0.03; free space"',
    "event=probe_no_slot error=\"409 SlotBudgetExceeded: run 'default' does not fit\"",
]
UNPROMISED = [
    "rollout waiting for the fleet: ClientResponseError: 400, message='Bad Request', url='x'; 0s of "
    "TRAINER_FLEET_WAIT_S=600, retry in 1.0s",
    "rollout waiting for the fleet: InvalidURL: x; 0s of TRAINER_FLEET_WAIT_S=600, retry in 1.0s",
    'event=control_call_waiting call="POST /pause" cause="HTTP 500" attempt=1 retry_in_s=0.5',
    'event=control_call_waiting call="POST /pause" cause="ReadTimeoutError: read timed out" attempt=1',
    "rollout gave up: the fleet failed for 600s (TRAINER_FLEET_WAIT_S=600): ClientConnectorError: refused",
    'event=refused reason="the fleet answered 401: run key refused"',
]


@SETTINGS
@given(promised=st.lists(st.sampled_from(PROMISED), max_size=6), unpromised=st.sampled_from(UNPROMISED),
       at=st.integers(0, 6))
def test_an_error_the_docs_do_not_promise_to_retry_is_caught_among_promised_ones(
        tmp_path_factory, promised: list[str], unpromised: str, at: int) -> None:
    run = trained(Plan(max_steps=4, save_steps=2, groups=1, max_staleness=2, kills=[(1, False)]))
    run.log[1:1] = [stamped(EPOCH + 1.5, line) for line in promised]
    clean = write(tmp_path_factory.mktemp("chaos"), {"a": run})
    assert check_folder(clean).ok, render(check_folder(clean))
    planted = stamped(EPOCH + 1.5, unpromised)
    run.log.insert(1 + min(at, len(promised)), planted)
    assert _violated(write(tmp_path_factory.mktemp("chaos"), {"a": run}), "errors_retried") == planted


@pytest.mark.parametrize("code", [1, 2, -6, -15])
def test_a_start_that_ended_on_its_own_error_is_caught(tmp_path: Path, code: int) -> None:
    """A start that exited neither done, nor refused, nor SIGKILLed by the nemesis: an error reached the trainer."""
    run = trained(Plan(max_steps=4, save_steps=2, groups=1, max_staleness=2, kills=[(1, False)]))
    run.exits[0] = code
    run.log.insert(1, stamped(EPOCH + 1.5, "ERROR requests.exceptions.HTTPError: 400 Client Error"))
    assert "HTTPError" in _violated(write(tmp_path, {"a": run}), "errors_retried")


@SETTINGS
@given(plan=plans(), off=st.sampled_from([(1, 0), (-1, 0), (0, 1)]), pick=st.integers(0, 10**6))
def test_a_start_resuming_off_its_checkpoints_head_is_caught_at_its_stream_line(tmp_path_factory, plan: Plan,
                                                                              off: tuple[int, int], pick: int) -> None:
    """One group late or early, or skipping a consumed group above the head it does not hold (consumed_above
    mislaid): the start's logged stream against the prompt log's checkpoint."""
    run = trained(plan)
    streams = [index for index, line in enumerate(run.log) if "event=prompt_stream" in line]
    index = streams[pick % len(streams)]
    head, skip = (int(v) for v in re.search(r"resume_at=(\d+) skip=(\d+)", run.log[index]).groups())  # type: ignore[union-attr]
    assume(head + off[0] >= 0)
    run.log[index] = run.log[index].replace(f"resume_at={head} skip={skip}",
                                            f"resume_at={head + off[0]} skip={skip + off[1]}")
    assert _violated(write(tmp_path_factory.mktemp("chaos"), {"a": run}), "resume_contract") == run.log[index]
