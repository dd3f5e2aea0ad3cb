"""The built-in tasks: task modules like any user's, named by TRAINER_TASK=math, jsonl or tiny."""
