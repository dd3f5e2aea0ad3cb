"""The task file TRAINER_TASK names, run as this module: one fixed, importable name for it in every process.

TRL pickles a task's rewards, tools and environment factory by reference (module and name) into its spawned
rollout process, and every rank loads the task itself. A file's own name need not be a module name (`my-tasks/x.py`)
and may clash with another; run here, its functions are `lorafleet_trainer.tasks.from_file.<name>` in every process
that imports this module with LORAFLEET_TASK_FILE set (the loader sets it; spawned processes and ranks inherit it).
The file's folder goes on sys.path, so it may import modules next to it.
"""

import os
import sys

from lorafleet_trainer.tasks.loader import TASK_FILE_ENV

_path = os.environ.get(TASK_FILE_ENV, "")
if not _path:
    raise ImportError(f"{TASK_FILE_ENV} is not set: lorafleet_trainer.tasks.from_file runs the task file it names")
if os.path.dirname(_path) not in sys.path:
    sys.path.insert(0, os.path.dirname(_path))
__file__ = _path  # inspect and tracebacks name the user's file
with open(_path, encoding="utf-8") as _source:
    _code = compile(_source.read(), _path, "exec")
del _source
exec(_code, globals())
