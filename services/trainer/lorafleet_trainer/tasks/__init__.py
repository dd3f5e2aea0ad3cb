"""Tasks: what the trainer trains on, in TRL's own types, from one Python file or module (docs/guides/tasks.md).

A task provides, as module-level names or from `build_task(tokenizer, settings)` returning a dict of them:
`train_dataset` (a `prompt` column), `reward_funcs`, and optionally `tools`, `environment_factory` and
`eval_dataset`. Module-level only: `defaults` (settings the task needs, applied where nobody set them),
`trl_args` (extra AsyncGRPOConfig fields) and `pass_threshold` (evaluation). The built-in tasks (math, jsonl,
tiny) are task modules in `builtin/`, loaded the same way.
"""
