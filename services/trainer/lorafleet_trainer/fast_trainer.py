"""TRL 1.16's AsyncGRPOTrainer with lorafleet's fast step (fast_step/): prefetched micro-batches, a sync-free loss.

A module of its own because it imports TRL at load time; `main.build_trainer` imports it only when the step needs it.
The subclass changes where and when TRL's work is done, not what it computes: the planner, collator, loss formula
and metric names are TRL's.
"""

from __future__ import annotations

from typing import Any

import torch
from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.experimental.async_grpo.async_grpo_trainer import (
    DataCollatorForRollout,
    FixedCountBatcher,
    RolloutQueueDataset,
    TokenBudgetBatcher,
)

from lorafleet_trainer.fast_step.loss import FAST_KEY, compact_batch, flush_loss_metrics, sync_free_loss
from lorafleet_trainer.fast_step.options import PLAIN, StepOptions
from lorafleet_trainer.fast_step.packing_process import PackingProcess
from lorafleet_trainer.fast_step.prefetch import MicroBatchStream, StepVersions
from lorafleet_trainer.fast_step.timing import StepTimer


class FastStepTrainer(AsyncGRPOTrainer):
    """AsyncGRPOTrainer whose step options (`configure_step`) decide how micro-batches are packed and the loss run."""

    step_options: StepOptions = PLAIN

    def configure_step(self, options: StepOptions, *, indexed_head: bool) -> StepOptions:
        """Set the options before `train()`; the sync-free loss needs one process and the indexed head. Returns them."""
        sync_free = options.sync_free_loss and indexed_head and self.accelerator.num_processes == 1 \
            and not self.aux_loss_enabled
        prefetch = options.prefetch and self.accelerator.num_processes == 1
        self.step_options = StepOptions(prefetch=prefetch, sync_free_loss=sync_free, fused_lora=options.fused_lora,
                                        liger=options.liger, packing=options.packing,
                                        switch_interval_s=options.switch_interval_s if prefetch else 0.0)
        self._step_timer = StepTimer(cuda=self.accelerator.device.type == "cuda" and sync_free)
        self._pending_loss_metrics: list[torch.Tensor] = []
        if sync_free:
            # transformers checks each micro-batch's loss for NaN/inf with a host read; the logged loss then sums
            # them as they are (training itself never used that check).
            self.args.logging_nan_inf_filter = False
        return self.step_options

    # --- data -------------------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> Any:
        options = self.step_options
        if not (options.prefetch or options.sync_free_loss):
            return super().get_train_dataloader()
        cuda = self.accelerator.device.type == "cuda"
        versions = StepVersions(self.args.gradient_accumulation_steps, self.args.weight_sync_steps)

        def start() -> None:  # the first step is about to be packed: the cold sync is done
            versions.start_step, versions.start_version = self.state.global_step, self.model_version

        stream = MicroBatchStream(
            deliver=self._deliver_packing_metrics,
            prepare=compact_batch if options.sync_free_loss else None,
            threaded=options.prefetch,
            depth=self.args.gradient_accumulation_steps,
            device=self.accelerator.device,
            pin=cuda,
            on_start=start,
            switch_interval_s=options.switch_interval_s,
        )
        if options.prefetch:
            def version() -> int:
                return versions.at(stream.building, self.model_version)
        else:
            def version() -> int:
                return self.model_version
        samples = RolloutQueueDataset(
            rollout_queue=self.rollout_queue,
            model_version_fn=version,
            check_health_fn=self.rollout_worker.check_health,
            stale_after_s=self.args.heartbeat_stale_after_s,
            metrics=stream.sink,
            max_staleness=self.args.max_staleness,
            report_to=self.args.report_to,
        )
        if self.args.token_budget is None:  # as TRL: the server's max_model_len
            self.vllm_client.wait_for_server_ready()
            self.args.token_budget = self.vllm_client.get_max_model_len()
        if options.prefetch and options.packing == "process":
            stream.process = PackingProcess(
                rollout_queue=self.rollout_queue,
                version_value=self.rollout_worker._model_version_value,
                versions=versions,
                pad_token_id=self.processing_class.pad_token_id,
                token_budget=self.args.token_budget,
                batch_size=self.args.per_device_train_batch_size,
                max_staleness=self.args.max_staleness,
                compact=options.sync_free_loss,
                depth=self.args.gradient_accumulation_steps,
                idle_check=lambda: self.rollout_worker.check_health(self.args.heartbeat_stale_after_s),
            )
            self._rollout_dataset = stream
            return stream
        if self.args.token_budget > 0:
            planner: Any = TokenBudgetBatcher(samples, 1, self.args.token_budget, stream.sink)
        else:
            planner = FixedCountBatcher(samples, 1, self.args.per_device_train_batch_size)
        stream.bind(planner, DataCollatorForRollout(
            self.processing_class.pad_token_id, 1, groups_trained=stream.groups, metrics=stream.sink,
            token_budget=max(self.args.token_budget, 0),
        ))
        # TRL flushes `_rollout_dataset.wait_s` as perf/rollout_wait_s: with prefetching, the training loop's wait
        self._rollout_dataset = stream if options.prefetch else samples
        return stream

    def _deliver_packing_metrics(self, metrics: dict[str, list], groups: set) -> None:
        sink = self._metrics["train"]
        for key, values in metrics.items():
            sink[key].extend(values)
        self._trained_groups.update(groups)

    # --- loss and timing --------------------------------------------------------------------------------------

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> torch.Tensor:
        if FAST_KEY in inputs:
            return sync_free_loss(self, model, inputs)
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any) -> torch.Tensor:
        timer = getattr(self, "_step_timer", None)
        if timer is not None:
            timer.microbatch_begin()
        loss = super().training_step(model, inputs, num_items_in_batch)
        if timer is not None:
            timer.microbatch_end()
        return loss

    def _log_step_metrics(self) -> None:
        flush_loss_metrics(getattr(self, "_pending_loss_metrics", []), self._metrics["train"])
        timer = getattr(self, "_step_timer", None)
        measured = timer.read() if timer is not None else None
        if measured is not None:
            self._current_train_step_time, self._step_forward_s = measured
        super()._log_step_metrics()
