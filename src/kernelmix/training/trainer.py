"""The pieces every training loop here is made of: one optimizer step, a schedule of evaluations,
checkpoints and the stop, and :class:`Trainer`, whose :meth:`~Trainer.run` drives them.

``kernelmix train`` (:mod:`.loop`) and finetuning (:func:`kernelmix.pretrained.finetune`) are two
subclasses of :class:`Trainer`: each says where its batches come from, what a batch's loss is,
the learning rate of a step, and what evaluating and saving mean for it; the order of things is
the same for both::

    step = start
    loop:  before_boundary → evaluate (if due) → save (if due) → stop? → before_step → step → after_step

Steps count optimizer updates done: "step s" is the state after s updates, so step 0 is the
untrained model and the update that takes step s to s + 1 uses the learning rate of ``s``.

SIGINT/SIGTERM during :meth:`Trainer.run` (:mod:`.signals`) end the loop at the next step boundary
as if the schedule stopped there: what is due there is evaluated, a checkpoint is saved, and
:meth:`Trainer.interrupted` builds the :class:`~kernelmix.errors.Interrupted` that is raised. A
resumed run then continues exactly as the uninterrupted one would have.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import Tensor

from ..errors import Interrupted
from .signals import catch_stop_signals, signal_name


@dataclass
class StepOutcome:
    """One optimizer step. ``loss``: the mean of the micro-batches' losses (a 0-dim float32 tensor
    on the device); ``grad_norm``: the global gradient norm before clipping (0-dim, on the
    device); ``updated``: whether the optimizer stepped (False: a non-finite loss or gradient
    norm skipped the update)."""

    loss: Tensor
    grad_norm: Tensor
    updated: bool = True


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Any],
    loss_of: Callable[[Any], Tensor],
    *,
    params: Sequence[torch.nn.Parameter],
    grad_clip: float,
    sync: Callable[[bool], ContextManager] | None = None,
    skip_non_finite: bool = False,
    agree: Callable[[Tensor], Tensor] | None = None,
) -> StepOutcome:
    """One update over ``micro_batches`` (gradient accumulation): the mean of their losses is
    minimised, the gradient of ``params`` is clipped to norm ``grad_clip`` (0: no clipping) and the
    optimizer steps.

    Args:
        optimizer: the optimizer; its gradients are zeroed before and after.
        micro_batches: the step's micro-batches, anything ``loss_of`` takes.
        loss_of: a micro-batch → its loss (a 0-dim tensor to backpropagate).
        params: the parameters whose global gradient norm is clipped and returned.
        grad_clip: the max gradient norm; 0: no clipping (the norm is still computed).
        sync: ``sync(last)``: a context for each micro-batch's backward (DDP's ``no_sync``
            except after the last); None: none.
        skip_non_finite: an update whose loss or gradient norm is not finite is skipped, leaving
            parameters and optimizer state as they were (a finite loss can have a NaN gradient: stepping on
            it turns every parameter into NaN). One device sync per step decides it. Every backward runs
            even after a non-finite loss, because under DDP each one's gradient all-reduce must happen on
            every process.
        agree: sums this process's count of non-finite values over the processes, so that all of them
            skip the same updates; None: this process decides alone.

    Returns:
        :class:`StepOutcome`: the mean loss, the gradient norm before clipping and whether the optimizer stepped."""
    optimizer.zero_grad(set_to_none=True)  # a no-op in a loop; gradients left by earlier use go
    total: Tensor | None = None
    for index, batch in enumerate(micro_batches):
        with sync(index == len(micro_batches) - 1) if sync is not None else contextlib.nullcontext():
            loss = loss_of(batch) / len(micro_batches)
            total = torch.zeros((), device=loss.device) if total is None else total
            total += loss.detach()
            loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
        grad_norm = grad_norm.full_tensor()
    updated = True
    if skip_non_finite:
        bad = (~torch.isfinite(total)).float() + (~torch.isfinite(grad_norm)).to(total.device).float()
        updated = not bool(agree(bad) if agree is not None else bad)
    if updated:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepOutcome(total, grad_norm, updated)


@dataclass(frozen=True)
class Schedule:
    """When a loop evaluates, saves and stops. It evaluates at step 0, every ``eval_every`` steps
    (0: never in between) and at the last step, but not at the step it resumed from (evaluated
    before that checkpoint was written); it saves every ``checkpoint_every`` steps (0: never in
    between), at the last step and, with ``save_at_stop``, where ``stop_at`` ends it early — never
    at the step it started from. ``can_evaluate`` False: no evaluation at all (nothing held out)."""

    total_steps: int
    start_step: int = 0
    resumed: bool = False
    eval_every: int = 0
    checkpoint_every: int = 0
    stop_at: int | None = None
    save_at_stop: bool = True
    can_evaluate: bool = True

    def stopping(self, step: int) -> bool:
        return step == self.total_steps or step == self.stop_at

    def eval_due(self, step: int) -> bool:
        if not self.can_evaluate or (self.resumed and step == self.start_step):
            return False
        return step in (0, self.total_steps) or (self.eval_every > 0 and step % self.eval_every == 0)

    def save_due(self, step: int) -> bool:
        if step <= self.start_step:
            return False
        return (step == self.total_steps or (self.save_at_stop and self.stopping(step))
                or (self.checkpoint_every > 0 and step % self.checkpoint_every == 0))


@dataclass(frozen=True)
class Due:
    """What happens at a step boundary, before the next update."""

    evaluate: bool
    save: bool
    stop: bool


class Trainer:
    """A training loop in pieces. A subclass sets :attr:`optimizer`, :attr:`params` (what is
    clipped), :attr:`grad_clip`, :attr:`schedule` and defines :meth:`lr`, :meth:`micro_batches`
    and :meth:`loss`; the hooks are optional. :meth:`run` drives the loop (see the module
    docstring) and returns the step it stopped at."""

    optimizer: torch.optim.Optimizer
    params: Sequence[torch.nn.Parameter]
    grad_clip: float
    schedule: Schedule
    skip_non_finite: bool = False  # see optimizer_step

    # -- what a subclass defines -------------------------------------------------------------

    def lr(self, step: int) -> float:
        raise NotImplementedError

    def micro_batches(self, step: int) -> Sequence[Any]:
        """The micro-batches of the update from ``step`` to ``step + 1``."""
        raise NotImplementedError

    def loss(self, batch: Any) -> Tensor:
        raise NotImplementedError

    def evaluate(self, step: int) -> None:
        """Evaluate at ``step`` (when :attr:`schedule` says so) and record the result."""

    def save(self, step: int) -> None:
        """Write a checkpoint of ``step`` (when :attr:`schedule` says so)."""

    # -- hooks --------------------------------------------------------------------------------

    def sync(self, last: bool) -> ContextManager:
        """The context of a micro-batch's backward; ``last``: the step's last micro-batch."""
        return contextlib.nullcontext()

    def before_boundary(self, step: int, due: Due) -> None:
        """At every step boundary, before evaluating and saving (e.g. flush the log)."""

    def before_step(self, step: int) -> None:
        """Before the update from ``step`` (e.g. redraw random features)."""

    def after_step(self, step: int, outcome: StepOutcome) -> bool:
        """After the update that reached ``step``; return True to stop now (no evaluation or
        checkpoint of this step)."""
        return False

    def agree(self, count: Tensor) -> Tensor:
        """``count`` summed over the processes of the run (one process: itself)."""
        return count

    def agree_on_signal(self, received: int | None) -> int | None:
        """The stop signal every process acts on at this boundary (None: go on). Under many
        processes a signal reaches them at different moments; they must still stop at the same
        step, so a subclass that runs many combines theirs."""
        return received

    def interrupted(self, step: int, signal_number: int) -> Interrupted:
        """The error :meth:`run` raises after a stop signal, once ``step`` is saved (when due)."""
        return Interrupted(f"interrupted by {signal_name(signal_number)} at step {step}", signal_number)

    # -- the loop -----------------------------------------------------------------------------

    def step(self, step: int) -> StepOutcome:
        set_lr(self.optimizer, self.lr(step))
        return optimizer_step(self.optimizer, self.micro_batches(step), self.loss, params=self.params,
                              grad_clip=self.grad_clip, sync=self.sync, skip_non_finite=self.skip_non_finite,
                              agree=self.agree)

    def run(self) -> int:
        """Drive the loop (see the module docstring); returns the step it stopped at. A stop
        signal ends it at the next boundary: that step is evaluated if due and saved (unless no
        update was done since the start), then :meth:`interrupted`'s error is raised.

        One turn of the loop, in the order the code below calls things (``s`` starts at
        ``schedule.start_step``; what :class:`~kernelmix.training.loop.PretrainTrainer` does in a
        hook is on the right)::

            agree_on_signal(received)                the stop signal all processes act on
            due = Due(evaluate, save, stop)          from the schedule (and the signal)
            before_boundary(s, due)                  log the steps not yet logged
            evaluate(s)            if due.evaluate   validation loss
            save(s)                if due.save       checkpoint
            stop                   if due.stop
            before_step(s)                           redraw random features (every redraw_every)
            step(s):                                 one optimizer update
                set_lr(optimizer, lr(s))
                optimizer_step(optimizer, micro_batches(s), loss, ...):
                    for each micro-batch b:  with sync(last): loss(b).backward()
                    clip the gradient of params to grad_clip
                    agree(non-finite count)  if skip_non_finite
                    optimizer.step()         unless skipped
            s += 1
            after_step(s, outcome) → True: stop      queue loss and grad norm; count a skipped update

        After the loop, ``agree_on_signal`` once more (a signal during the last evaluation or save),
        then ``raise interrupted(s, signal)`` if there was one."""
        schedule = self.schedule
        step = schedule.start_step
        with catch_stop_signals() as signals:
            while True:
                signal_number = self.agree_on_signal(signals.received)
                interrupted = signal_number is not None
                due = Due(schedule.eval_due(step),
                          schedule.save_due(step) or (interrupted and step > schedule.start_step),
                          schedule.stopping(step) or interrupted)
                self.before_boundary(step, due)
                if due.evaluate:
                    self.evaluate(step)
                if due.save:
                    self.save(step)
                if due.stop:
                    break
                self.before_step(step)
                outcome = self.step(step)
                step += 1
                if self.after_step(step, outcome):
                    break
            # a signal during the last evaluation or save still stops the caller (a study's next run)
            signal_number = self.agree_on_signal(signals.received)
        if signal_number is not None:
            raise self.interrupted(step, signal_number)
        return step


__all__ = ["Due", "Schedule", "StepOutcome", "Trainer", "optimizer_step", "set_lr"]
