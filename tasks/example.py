"""An example task: answer with colours. Copy this file, change the data and the reward, train it.

    make demo TASK=tasks/example.py                  # processes on CPU, with the tiny model
    make train RUN=colours TASK=tasks/example.py     # on the running Compose stack (TASKS_DIR is mounted at /tasks)
    lorafleet doctor --task tasks/example.py         # the checks alone, no fleet needed
"""

import random

from datasets import Dataset

COLOURS = ("red", "blue", "green", "black", "white", "gold")

# Settings this task needs where nobody set them (lorafleet's names, lower case): here, the tiny model's scale.
defaults = {"num_generations": 8, "max_completion_length": 4, "temperature": 0.7, "learning_rate": 3e-3,
            "token_budget": 0, "train_batch_size": 32, "gradient_accumulation_steps": 1,
            "max_inflight_per_replica": 4, "queue_maxsize": 8, "weight_sync_steps": 1, "max_steps": 30}
pass_threshold = 0.5  # an eval row passes when its summed reward reaches this


def colour_share(completions, completion_ids, **kwargs):
    """The share of the reply's words that are colours (TRL passes one list entry per completion)."""
    scores = []
    for completion in completions:
        words = completion[0]["content"].split()  # completion: the assistant's messages of one rollout
        scores.append(sum(word in COLOURS for word in words) / len(words) if words else 0.0)
    return scores


def names_the_asked_colour(completions, colour, **kwargs):
    """1 when the reply names the colour the row asks for (`colour` is a dataset column)."""
    return [float(wanted in completion[0]["content"]) for completion, wanted in zip(completions, colour, strict=True)]


def build_task(tokenizer, settings):
    """Data may depend on the model or the settings: build it here (module-level names work too)."""
    rng = random.Random(settings.seed)
    rows = [{"prompt": f"the {rng.choice(('cat', 'dog', 'fox'))} is {colour} or {rng.choice(COLOURS)} ?",
             "colour": colour} for colour in (rng.choice(COLOURS) for _ in range(256))]
    return {"train_dataset": Dataset.from_list(rows[:240]), "eval_dataset": Dataset.from_list(rows[240:]),
            "reward_funcs": [colour_share, names_the_asked_colour]}
