"""Task files: loaded under one importable name, and every broken one refused with one line naming file and line."""

from __future__ import annotations

import multiprocessing
import pickle
import textwrap

import pytest
from lorafleet.settings import ConfigError, load_settings
from lorafleet_ops.tiny_model import make_tiny_model
from lorafleet_trainer.config import build_configs
from lorafleet_trainer.main import resolve_settings
from lorafleet_trainer.ranks import RankPlan
from lorafleet_trainer.recipes import load_tokenizer
from lorafleet_trainer.tasks.checks import TaskProblems, prepare_task
from lorafleet_trainer.tasks.loader import FILE_MODULE, read_task_settings
from lorafleet_trainer.tasks.spec import TaskError

HEADER = """\
from datasets import Dataset

train_dataset = Dataset.from_dict({"prompt": ["add two and two", "name a colour"], "answer": ["4", "red"]})


def exact(completions, answer, **kwargs):
    return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]


reward_funcs = [exact]
"""
HEADER_LINES = HEADER.count("\n")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(str(tiny))


def write_task(folder, body: str, header: bool = True):
    """A task file in a folder whose name is not a module name, outside the repo."""
    folder = folder / "my-tasks"
    folder.mkdir(exist_ok=True)
    path = folder / "the task.py"
    path.write_text((HEADER if header else "") + textwrap.dedent(body))
    return path


def problems_of(path, tokenizer, tiny, **settings):
    values = {"trainer_task": str(path), "base_model": str(tiny), "task_timeout_s": 2.0, **settings}
    with pytest.raises(ConfigError) as raised:
        prepare_task(load_settings(**values), tokenizer)
    error = raised.value
    return error.problems if isinstance(error, TaskProblems) else [error]


def test_a_good_task_file_loads_under_one_name_that_a_spawned_process_imports(tmp_path, tokenizer, tiny):
    path = write_task(tmp_path, "")
    task, _ = prepare_task(load_settings(trainer_task=str(path), base_model=str(tiny)), tokenizer)
    (reward,) = task.reward_funcs
    assert reward.__module__ == FILE_MODULE
    assert task.train_dataset[0]["prompt"] == [{"role": "user", "content": "add two and two"}]  # text -> messages
    assert task.summary()["rewards"] == ["exact"]
    # TRL's rollout process is spawned: it unpickles the reward by name, importing the file afresh from the env
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        scores = pool.apply(_call_pickled, (pickle.dumps(reward),))
    assert scores == [1.0, 0.0]


def _call_pickled(blob: bytes) -> list[float]:
    reward = pickle.loads(blob)
    return reward(completions=[[{"content": "4"}], [{"content": "blue"}]], answer=["4", "red"])


def test_task_defaults_and_trl_args_reach_the_settings_and_trl(tmp_path, monkeypatch, tiny):
    path = write_task(tmp_path, """
        defaults = {"learning_rate": 0.01, "max_steps": 7}
        trl_args = {"max_tool_calling_iterations": 3}
    """)
    monkeypatch.setenv("MAX_STEPS", "9")
    settings = resolve_settings({"trainer_task": str(path), "base_model": str(tiny)})
    assert (settings.learning_rate, settings.max_steps) == (0.01, 9)  # the environment wins over the task
    task_settings, _ = read_task_settings(str(path))
    grpo = build_configs(settings, replicas=1, ranks=RankPlan(1, "cpu", "none"), trl_args=task_settings.trl_args).grpo
    assert grpo.max_tool_calling_iterations == 3


def test_trl_args_may_not_set_what_lorafleet_sets(tiny):
    settings = load_settings(base_model=str(tiny))
    with pytest.raises(ConfigError, match=r"trl_args set learning_rate, which lorafleet sets .* `defaults`"):
        build_configs(settings, replicas=1, ranks=RankPlan(1, "cpu", "none"), trl_args={"learning_rate": 1.0})


BROKEN = {
    "syntax": ("x = (\n", r"syntax error: '\(' was never closed", HEADER_LINES + 1),
    "import_raises": ("1 / 0\n", "importing it raised ZeroDivisionError: division by zero", HEADER_LINES + 1),
    "missing_module": ("import nope_not_installed\n", "imports 'nope_not_installed', which is not installed: add it",
                       HEADER_LINES + 1),
    "defaults_unknown": ('defaults = {"learnin_rate": 1.0}\n', "`defaults` names learnin_rate, which are not "
                         "lorafleet settings", None),
    "defaults_not_dict": ("defaults = [1]\n", "`defaults` must be a dict, not list", None),
    "threshold_text": ('pass_threshold = "high"\n', "`pass_threshold` must be a number, not str", None),
    "trl_args_unknown": ('trl_args = {"max_tool_calls": 2}\n', r"`trl_args` names max_tool_calls, which "
                         r"AsyncGRPOConfig \(TRL 1.16\) does not have", None),
    "empty": ("train_dataset = Dataset.from_dict({'prompt': []})\n", "`train_dataset` is empty", None),
    "empty_list": ("train_dataset = []\n", "`train_dataset` is empty", None),
    "trl_args_lorafleet_sets": ('trl_args = {"num_generations": 2, "temperature": 1.0}\n', "`trl_args` set "
                                "num_generations, temperature, which lorafleet sets from its settings: set those in "
                                "the task's `defaults`", None),
    "no_prompt": ("train_dataset = Dataset.from_dict({'question': ['q']})\n",
                  r"`train_dataset` has no `prompt` column \(columns: question\)", None),
    "prompt_not_messages": ("train_dataset = Dataset.from_dict({'prompt': [5, 6], 'answer': ['4', 'red']})\n",
                            r"`train_dataset` row 0: `prompt` is 5; give text or a list of", None),
    "not_a_dataset": ("train_dataset = 'rows.jsonl'\n", "`train_dataset` is a str; give a datasets.Dataset", None),
    "lambda_reward": ("reward_funcs = [lambda completions, **kw: [0.0] * len(completions)]\n",
                      "reward `<lambda>` cannot be pickled .* define it at module level", HEADER_LINES + 1),
    "reward_not_callable": ("reward_funcs = [3]\n", "reward 3 is not callable", None),
    "no_reward": ("reward_funcs = []\n", "no reward: define `reward_funcs`", None),
    "reward_raises": ("def bad(completions, **kw):\n    return [kw['solution'] for _ in completions]\n"
                      "reward_funcs = [bad]\n", r"reward `bad` raised KeyError: 'solution' on 2 dummy completions.*"
                      r"the dataset's columns: answer", HEADER_LINES + 2),
    "reward_wrong_length": ("def short(completions, **kw):\n    return [1.0]\nreward_funcs = [short]\n",
                            "reward `short` returned 1 scores for 2 completions", HEADER_LINES + 1),
    "reward_not_a_list": ("def text(completions, **kw):\n    return 'good'\nreward_funcs = [text]\n",
                          "reward `text` returned str, not a list of 2 scores", HEADER_LINES + 1),
    "reward_nan": ("def nan(completions, **kw):\n    return [float('nan')] * len(completions)\nreward_funcs = [nan]\n",
                   "reward `nan` 2 of 2 scores are not finite numbers", HEADER_LINES + 1),
    "reward_hangs": ("import time\ndef slow(completions, **kw):\n    time.sleep(30)\nreward_funcs = [slow]\n",
                     r"reward `slow` did not return within TASK_TIMEOUT_S=2s", HEADER_LINES + 2),
    "tool_no_docstring": ("def add(a: int, b: int) -> int:\n    return a + b\ntools = [add]\n",
                          "tool `add`: .*docstring", HEADER_LINES + 1),
    "tool_no_hints": ('def add(a, b):\n    """Add.\n\n    Args:\n        a: one\n        b: two\n    """\n'
                      "    return a + b\ntools = [add]\n", "tool `add`: .*type hint", HEADER_LINES + 1),
    "tool_lambda": ("tools = [lambda a: a]\n", "tool `<lambda>` cannot be pickled", HEADER_LINES + 1),
    "env_no_reset": ("class Game:\n    pass\nenvironment_factory = Game\n",
                     r"the environment `environment_factory` builds \(Game\) has no `reset\(self, \*\*row\)`",
                     HEADER_LINES + 1),
    "env_reset_raises": ("class Game:\n    def reset(self, prompt):\n        return None\nenvironment_factory = Game\n",
                         r"`Game.reset\(\*\*row 0\)` raised TypeError: .*unexpected keyword argument 'answer'.*"
                         r"accept \*\*kwargs", HEADER_LINES + 2),
    "env_reward_garbage": ("class Game:\n    def reset(self, **row):\n        return None\n"
                           "    def get_reward(self):\n        return 'won'\nenvironment_factory = Game\n",
                           r"`Game.get_reward\(\)` returned 'won'; return a float", HEADER_LINES + 4),
    "build_not_dict": ("del train_dataset\ndef build_task(tokenizer, settings):\n    return [1]\n",
                       "build_task\\(\\) returned list; return a dict", HEADER_LINES + 2),
    "build_unknown_key": ("del train_dataset\ndef build_task(tokenizer, settings):\n    return {'train_set': 1}\n",
                          r"build_task\(\) returned unknown keys train_set", HEADER_LINES + 2),
    "build_twice": ("def build_task(tokenizer, settings):\n    return {'train_dataset': train_dataset}\n",
                    r"train_dataset given both at module level and by build_task\(\)", HEADER_LINES + 1),
    "build_raises": ("def build_task(tokenizer, settings):\n    return {'eval_dataset': open('/nope/eval.jsonl')}\n",
                     "build_task\\(\\) raised FileNotFoundError", HEADER_LINES + 2),
    "no_data": ("del train_dataset\n", "no training data: define `train_dataset`", None),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_each_broken_task_is_one_line_naming_the_file_the_line_and_the_fix(case, tmp_path, tokenizer, tiny):
    body, message, line = BROKEN[case]
    path = write_task(tmp_path, body)
    (problem,) = problems_of(path, tokenizer, tiny)
    assert isinstance(problem, TaskError)
    assert problem.where == str(path) and "\n" not in str(problem)
    assert problem.line == line, str(problem)
    assert str(problem).startswith(f"{path}:{line}: " if line else f"{path}: ")
    assert __import__("re").search(message, problem.problem), problem.problem


def test_a_template_that_drops_the_tools_is_refused(tmp_path, tiny):
    tokenizer = load_tokenizer(str(tiny))
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    path = write_task(tmp_path, '''
        def lookup(key: str) -> str:
            """Look a key up.

            Args:
                key: what to look up
            """
            return key
        tools = [lookup]
    ''')
    (problem,) = problems_of(path, tokenizer, tiny)
    assert "chat template does not render the tools lookup: the model would never see them" in problem.problem


def test_several_problems_are_all_reported(tmp_path, tokenizer, tiny):
    path = write_task(tmp_path, "def short(completions, **kw):\n    return []\nreward_funcs = [short, 3]\n")
    problems = problems_of(path, tokenizer, tiny)
    assert [p.problem.split(" ")[1] for p in problems] == ["`short`", "3"]


def test_a_base_model_that_cannot_be_loaded_is_one_line_naming_base_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = write_task(tmp_path, "")
    with pytest.raises(ConfigError, match=r"^BASE_MODEL: cannot load the tokenizer of '/no/model' to check") as raised:
        prepare_task(load_settings(trainer_task=str(path), base_model="/no/model"))
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(("task", "message"), [
    ("/no/such/task.py", r"TRAINER_TASK=/no/such/task.py: no such file"),
    ("not_a_module_anywhere", "no module of that name"),
    ("has spaces", "neither a built-in task, a .py file nor a module name"),
])
def test_a_task_that_cannot_be_found_is_named(task, message):
    with pytest.raises(TaskError, match=message):
        read_task_settings(task)


def test_the_guides_example_is_tasks_example_py_and_passes_every_check(tokenizer, tiny):
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    example = repo / "tasks" / "example.py"
    guide = (repo / "docs" / "guides" / "tasks.md").read_text()
    assert f"```python\n{example.read_text()}```" in guide  # docs/guides/tasks.md shows the file as it is
    task, _ = prepare_task(load_settings(trainer_task=str(example), base_model=str(tiny)), tokenizer)
    assert task.summary()["rewards"] == ["colour_share", "names_the_asked_colour"]
    assert len(task.eval_dataset) == 16 and task.settings.pass_threshold == 0.5
