"""The lifecycle every front door (``Pipe``, ``DistributedPipe``) shares.

One plan for every front door (``plan``: the checked arguments as a frozen ``Layout``, the
model traced and cut, the balance, skips, ties, placement and first schedule, as a frozen
``Blueprint``, before any device work); the steps (``lifecycle``: micro-batches, runs, traces,
the automatic choices, ``last_step``; ``training``: ``train_step``, its checked arguments in
``arguments``, clipping, ``no_sync``); and ``FrontDoor`` (``door``), which a front door
subclasses: it plans, takes the plan (``_begin``), realises it on its devices and plugs in its
driver (``fastpipe.runtime.drivers.base``).
"""
from .arguments import (LOSS_REDUCTIONS, StepEnding, UncertainWeighting, check_ending,
                        check_step_arguments, loss_weights, warn_uneven_mean)
from .door import FrontDoor
from .layout import Layout, check_checkpoint, first_schedule, parse_layout, validated_schedule
from .plan import Blueprint, OnDevices, OnRanks, plan_pipeline

__all__ = ["LOSS_REDUCTIONS", "Blueprint", "FrontDoor", "Layout", "OnDevices", "OnRanks",
           "StepEnding", "UncertainWeighting", "check_checkpoint", "check_ending",
           "check_step_arguments", "first_schedule", "loss_weights", "parse_layout",
           "plan_pipeline", "validated_schedule", "warn_uneven_mean"]
