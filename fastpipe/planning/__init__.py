"""Plan before running: the step time and memory of a pipeline layout at any scale.

``hardware`` names GPU types and their links (each number stated with its source, one
efficiency calibrated), ``model_shape`` reads a transformer's dimensions, ``runtime_model``
says how a runtime overlaps its communication, ``layout`` is one layout, ``costs`` turns it
into the per-chunk costs the schedule simulator takes (FLOPs and bytes of F, B and W,
transfers, reductions, the optimizer, memory), ``predict`` simulates one layout, ``layouts``
enumerates and prunes them and ``plan`` ranks them (:func:`~fastpipe.planning.plan.plan`);
``published`` recomputes published training runs; ``calibrate`` measures one layer on this
machine (it alone imports torch).
"""
from .hardware import GPU, GPUS, Link, gpu
from .layout import Layout
from .model_shape import ModelShape, from_hf_config, model_shape
from .plan import Plan, plan
from .predict import Prediction, predict

__all__ = ["GPU", "GPUS", "Layout", "Link", "ModelShape", "Plan", "Prediction",
           "from_hf_config", "gpu", "model_shape", "plan", "predict"]
