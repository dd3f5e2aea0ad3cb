"""Every patch lorafleet makes to TRL's objects, classes and modules, in one room and one ordered list (PATCHES).

Written against TRL 1.16.0 (TRL_VERSION). Each patch is one small function here; the modules that need one (cpu,
attention, resilience, published_files, provenance, ratio_by_replica, resume, fleet_rollouts, lifecycle, main) call
it with their own replacement and never assign onto TRL themselves. PATCHES lists them in the order a start applies
them, each with what it replaces, why, the TRL names it relies on (`expects`: checked against the installed TRL by
tests/unit/trainer/test_trl_seam.py, which fails naming the attribute) and whether TRL offers an extension point.

TRL's own extension points are used where they exist: subclass overrides (fleet_rollouts.FleetRolloutLoop of TRL's
rollout loop, fast_trainer.FastStepTrainer of the trainer: their overridden names are in OVERRIDES), Trainer
callbacks (lifecycle, resume, evaluation, exporter, ratio_by_replica), constructor arguments (AsyncGRPOConfig,
`peft_config`, `callbacks`). The patches below are the rest: TRL 1.16 has no hook for them; each says what TRL change
would remove it. Light on purpose: TRL is imported inside the functions, never at load time.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TRL_VERSION = "1.16.0"
TRAINER = "trl.experimental.async_grpo.async_grpo_trainer"
WORKER = "trl.experimental.async_grpo.async_rollout_worker"
VLLM_CLIENT = "trl.experimental.async_grpo.vllm_client"
PACKING = "trl.experimental.async_grpo.packing"
SCORE_QUEUE_KWARG = "score_queue_maxsize"  # the rollout loop's argument TRL's config does not expose
Save = Callable[[Any, Any], None]  # TRL's _save_checkpoint(model, trial)


@dataclass(frozen=True)
class Expects:
    """A TRL name a patch relies on: `attribute` (dotted) in `module`, or, with `assigned_in`, an instance attribute
    the source of `module`.`assigned_in` assigns (`self.<attribute> =`)."""

    module: str
    attribute: str
    assigned_in: str = ""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.assigned_in or self.attribute}" + (
            f" (self.{self.attribute})" if self.assigned_in else "")

    def missing(self) -> str | None:
        """Why the installed TRL lacks this name, or None when it has it."""
        try:
            owner: Any = importlib.import_module(self.module)
        except ImportError as exc:
            return f"{self.module} cannot be imported: {exc}"
        for part in (self.assigned_in or self.attribute).split("."):
            if not hasattr(owner, part):
                return f"{self.name}: TRL has no {part!r} there"
            owner = getattr(owner, part)
        if self.assigned_in and f"self.{self.attribute} =" not in inspect.getsource(owner).replace(
                f"self.{self.attribute}: ", f"self.{self.attribute} = "):
            return f"{self.name}: {self.assigned_in} no longer assigns self.{self.attribute}"
        return None


@dataclass(frozen=True)
class Patch:
    """One patch of TRL: the function here that makes it, what it replaces, why, and what would remove it."""

    function: str
    target: str
    reason: str
    no_hook: str  # why TRL 1.16 offers no extension point for it, and the TRL change that would remove it
    expects: tuple[Expects, ...]


def _module(name: str) -> Any:
    return importlib.import_module(name)


# -- module patches: before the trainer is built (its __init__ reads them) -------------------------------------------
def set_peak_flops_query(query: Callable[[Any, str], Any]) -> None:
    _module(TRAINER).get_peak_flops_per_device = query


def set_attention_kernel(kernel_factory: Callable[[], Any]) -> None:
    _module(PACKING)._flash_attn = kernel_factory


def set_control_requests(requests_module: Any) -> None:
    _module(VLLM_CLIENT).requests = requests_module


def wrap_adapter_load(wrap: Callable[[Callable[..., None]], Callable[..., None]]) -> None:
    client = _module(VLLM_CLIENT).VLLMClient
    client.load_lora_adapter = wrap(client.load_lora_adapter)


def adapter_load() -> Callable[..., None]:
    """TRL's VLLMClient.load_lora_adapter as it is now (patched or not)."""
    return _module(VLLM_CLIENT).VLLMClient.load_lora_adapter


# -- object patches: the built trainer and its rollout worker, before train() spawns the child ----------------------
def set_loop_kwargs(worker: Any, **kwargs: Any) -> None:
    worker._loop_kwargs.update(kwargs)


def loop_kwargs(worker: Any) -> dict[str, Any] | None:
    """The worker's `_loop_kwargs` (what its child's loop is built with), None when this TRL has none."""
    found = getattr(worker, "_loop_kwargs", None)
    return found if isinstance(found, dict) else None


def wrap_rollout_queue(trainer: Any, wrap: Callable[[Any], Any]) -> None:
    trainer.rollout_queue = wrap(trainer.rollout_queue)


def wrap_compute_loss(trainer: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    trainer.compute_loss = wrap(trainer.compute_loss)


def wrap_save_checkpoint(trainer: Any, wrap: Callable[[Save], Save]) -> None:
    trainer._save_checkpoint = wrap(trainer._save_checkpoint)


def set_trained_groups(trainer: Any, groups: set[int]) -> None:
    trainer._trained_groups = groups


def set_process_context(worker: Any, context: Any) -> None:
    worker._mp_ctx = context


def wrap_health_check(worker: Any, wrap: Callable[[Callable[[float], None]], Callable[[float], None]]) -> None:
    worker.check_health = wrap(worker.check_health)


def set_loop_class(worker: Any, loop_cls: type) -> None:
    worker._loop_cls = loop_cls


def set_step_options(trainer: Any, step: Any) -> None:
    trainer.lorafleet_step = step


# -- at train begin and at a stop ------------------------------------------------------------------------------------
def set_resume_point(trainer: Any, groups_before: int, model_version: int) -> None:
    trainer._groups_before_resume = groups_before
    trainer.model_version = model_version
    trainer.rollout_worker.update_model_version(model_version)


def rollout_child(worker: Any) -> Any:
    """The worker's child process (TRL's `_process`), None before it started."""
    return getattr(worker, "_process", None)


def save_checkpoint(trainer: Any) -> None:
    """TRL's own checkpoint save (with its rollout_state.json), called outside the Trainer's save schedule."""
    trainer._save_checkpoint(trainer.model, trial=None)


_WORKER_INIT = "AsyncRolloutWorker.__init__"
_TRAINER_INIT = "AsyncGRPOTrainer.__init__"

PATCHES: tuple[Patch, ...] = (
    Patch("set_peak_flops_query", f"{TRAINER}.get_peak_flops_per_device",
          "CPU only (cpu.py): TRL asks CUDA for the device's peak FLOPs in the trainer's __init__; a CPU has none",
          "none: a TRL that skipped MFU for a device without a peak-FLOPs entry would remove it",
          (Expects(TRAINER, "get_peak_flops_per_device"),)),
    Patch("set_attention_kernel", f"{PACKING}._flash_attn",
          "attention.py: the varlen kernel TRL's tree attention calls, where the Hub's FA3 cannot load",
          "none: an AsyncGRPOConfig field (or attn_implementation) choosing the varlen kernel would remove it",
          (Expects(PACKING, "_flash_attn"),)),
    Patch("set_control_requests", f"{VLLM_CLIENT}.requests",
          "resilience.py: TRL's control calls (pause, load, resume, unload) send the run key and ride out a proxy "
          "restart (the proxy client's retrying session)",
          "none: VLLMClient calls the module's requests.get/post; a session or headers argument would remove it",
          (Expects(VLLM_CLIENT, "requests"), Expects(VLLM_CLIENT, "VLLMClient.pause"))),
    Patch("wrap_adapter_load", f"{VLLM_CLIENT}.VLLMClient.load_lora_adapter",
          "published_files.py: the adapter's files made readable by the proxy (another user) before it is loaded",
          "none: the trainer builds its VLLMClient itself; a vllm_client argument, or TRL writing the adapter's "
          "files 0644, would remove it",
          (Expects(VLLM_CLIENT, "VLLMClient.load_lora_adapter"),)),
    Patch("set_loop_kwargs", f"{WORKER}.AsyncRolloutWorker._loop_kwargs",
          "main.build_trainer (score-queue bound), resume.py (where the child's prompt stream starts) and "
          "fleet_rollouts.py (run key, fleet wait, task timeout, episode pins): the child's loop is built from them",
          "none: AsyncGRPOConfig has no score-queue field and the worker takes no extra loop arguments; a "
          "`loop_kwargs` argument to AsyncGRPOTrainer would remove it",
          (Expects(WORKER, "_loop_kwargs", _WORKER_INIT), Expects(TRAINER, "rollout_worker", _TRAINER_INIT))),
    Patch("wrap_rollout_queue", f"{TRAINER}.AsyncGRPOTrainer.rollout_queue",
          "provenance.py (rollouts.jsonl: who answered each sample read) then resume.py (stale drops noted)",
          "none: TRL reads the queue in its dataset without a hook; a callback per sample read would remove it",
          (Expects(TRAINER, "rollout_queue", _TRAINER_INIT),)),
    Patch("wrap_compute_loss", f"{TRAINER}.AsyncGRPOTrainer.compute_loss",
          "ratio_by_replica.py: the loss's forward observed, each token's log-ratio counted for its replica",
          "a subclass override would do (transformers' documented one), but the class is TRL's or the fast "
          "step's, chosen after the callbacks are built: one wrap serves both",
          (Expects(TRAINER, "AsyncGRPOTrainer.compute_loss"),)),
    Patch("wrap_save_checkpoint", f"{TRAINER}.AsyncGRPOTrainer._save_checkpoint",
          "resume.py: the completeness marker before a checkpoint's first file, the consumed prompts after TRL's",
          "none: transformers' on_save runs after the files; a callback before a save starts would remove it",
          (Expects(TRAINER, "AsyncGRPOTrainer._save_checkpoint"),)),
    Patch("set_trained_groups", f"{TRAINER}.AsyncGRPOTrainer._trained_groups",
          "resume.py: the collated groups queued until the step that trains them ends (TRL counts them collated)",
          "none: TRL 1.16 records a group when collated, one micro-batch early; a per-step record would remove it",
          (Expects(TRAINER, "_trained_groups", _TRAINER_INIT),)),
    Patch("set_process_context", f"{WORKER}.AsyncRolloutWorker._mp_ctx",
          "lifecycle.py: the rollout child forked from the fork server with stop signals blocked (rollout_server.py)",
          "none: the worker picks spawn itself; a multiprocessing-context argument would remove it",
          (Expects(WORKER, "_mp_ctx", _WORKER_INIT), Expects(WORKER, "_process", _WORKER_INIT))),
    Patch("wrap_health_check", f"{WORKER}.AsyncRolloutWorker.check_health",
          "lifecycle.py: a stop that is due abandons the wait for rollouts (a step boundary)",
          "none: the trainer's rollout wait has no callback; an on-wait hook would remove it",
          (Expects(WORKER, "AsyncRolloutWorker.check_health"),)),
    Patch("set_loop_class", f"{WORKER}.AsyncRolloutWorker._loop_cls",
          "fleet_rollouts.py: the child runs FleetRolloutLoop (run key, fleet wait, guards, provenance)",
          "a subclass of the worker would set it, but TRL builds the worker; a rollout_worker built by lorafleet "
          "(TRL's constructor argument) means copying TRL's ~20 worker arguments, so the class attribute is set",
          (Expects(WORKER, "AsyncRolloutWorker._loop_cls"), Expects(WORKER, "_AsyncRolloutLoop"))),
    Patch("set_step_options", f"{TRAINER}.AsyncGRPOTrainer.lorafleet_step",
          "main.build_trainer: the fast step's options ride on the trainer (read by the benchmark and the fast step)",
          "an attribute of lorafleet's own, added, replacing nothing of TRL's",
          ()),
    Patch("set_resume_point", f"{TRAINER}.AsyncGRPOTrainer._groups_before_resume, .model_version",
          "resume.py at train begin: TRL's epoch count from the consumed prompts, the next adapter version past "
          "every name published (TRL set them from its own rollout_state.json fields)",
          "none: TRL's resume reads rollout_state.json itself; a callback-settable resume point would remove it",
          (Expects(TRAINER, "_groups_before_resume", _TRAINER_INIT), Expects(TRAINER, "model_version", _TRAINER_INIT),
           Expects(WORKER, "AsyncRolloutWorker.update_model_version"))),
)

# TRL's own extension point, a subclass: the names each lorafleet subclass overrides or calls on its TRL base. A TRL
# that renamed one would leave an override dead (never called) rather than fail: the seam's test names it.
OVERRIDES: tuple[tuple[str, Expects], ...] = tuple(
    (subclass, Expects(module, f"{base}.{name}"))
    for subclass, module, base, names in (
        ("fleet_rollouts.FleetRolloutLoop", WORKER, "_AsyncRolloutLoop",
         ("_repeat_iterator", "_request_model", "_generate_one", "_score_group", "_post", "_execute_tool_calls",
          "_push_metrics", "_retry", "_run_loops", "_generate_one_turn")),
        ("fast_trainer.FastStepTrainer", TRAINER, "AsyncGRPOTrainer",
         ("get_train_dataloader", "compute_loss", "training_step", "_log_step_metrics")),
    )
    for name in names
)
