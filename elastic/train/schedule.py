"""The run's schedule: which steps are logged, checkpointed, validated, agreed on, and
when training ends. A function of the config, the steps an epoch has and the state:
the same answer on every rank, so every rank makes the same collectives."""

from __future__ import annotations

from elastic.config.schema import TrainConfig
from elastic.train.checkpoint import TrainerState


class Schedule:
    def __init__(self, cfg: TrainConfig, steps_per_epoch: int) -> None:
        self.trainer, self.every = cfg.trainer, cfg.checkpoint.every_steps
        self.steps_per_epoch = steps_per_epoch

    def logs_at(self, step: int) -> bool:
        """The first step, every ``trainer.log_every_steps``-th, the last."""
        t = self.trainer
        last = (t.max_steps > 0 and step >= t.max_steps) or step == t.stop_at_step
        return last or step == 1 or step % t.log_every_steps == 0

    def checkpoints_at(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0)

    def validates_at(self, step: int) -> bool:
        every = self.trainer.val_every_steps
        return bool(every and step % every == 0)

    def agreed_on(self, step: int, state: TrainerState) -> bool:
        """Steps every rank must agree on whatever the pace: those logged (their batch
        digest), checkpointed or validated after, and an epoch's last."""
        return (
            self.logs_at(step)
            or self.checkpoints_at(step)
            or self.validates_at(step)
            or step - state.epoch_start_step >= self.steps_per_epoch
        )

    def stops_at(self, state: TrainerState) -> bool:
        """``trainer.stop_at_step`` reached: the run stops (resumable) at this step."""
        stop = self.trainer.stop_at_step
        return bool(stop and state.step >= stop)

    def done(self, state: TrainerState, stopped: bool) -> bool:
        """No step is left: a stopping rule, or ``stopped`` (a stop reason is set)."""
        t = self.trainer
        return (
            (t.max_steps > 0 and state.step >= t.max_steps)
            or (t.max_epochs > 0 and state.epoch >= t.max_epochs)
            or stopped
        )

    def ends_here(self, state: TrainerState, stopped: bool) -> bool:
        """This step is the run's last (a stopping rule, or the last step of the last
        epoch, which closes only after it): the final checkpoint and validation cover
        it."""
        t, s = self.trainer, state
        last_epoch = t.max_epochs > 0 and s.epoch + 1 >= t.max_epochs
        return self.done(s, stopped) or (
            last_epoch and s.step - s.epoch_start_step >= self.steps_per_epoch
        )
