"""Generation through the pipeline, with each stage keeping the KV cache of its own layers.

``pipe.generate(input_ids, max_new_tokens, ...)`` (``FrontDoor.generate``) runs a decode
schedule (:mod:`fastpipe.schedule.decode`): several groups of sequences in flight, every stage
decoding one group while the others' tokens travel, the next token going back from the last
stage to the first inside the runtime. Each forward is the model traced with its cache
(:mod:`.traced`) and cut at the pipe's split points (:mod:`.split`): a stage's graph reads and
writes only the cache tensors of its own layers. Greedy decoding equals ``transformers``'
``generate(do_sample=False)`` token for token; sampling equals its draws under the same seed on
the same device.

Modules: ``arguments`` (checks), ``protocol`` and ``hf`` (how a model is called, its cache as
tensors), ``traced``, ``split`` and ``bind`` (the forwards per stage), ``inputs`` and
``sampling`` (what the first stage feeds, what the last one picks), ``engine`` (the decode
schedule on the pipe's executors), ``ranks`` (a ``DistributedPipe``'s agreements), ``api``.
"""
from __future__ import annotations

from .api import Source, generate
from .bind import BindError
from .split import StepError
from .traced import skeleton

__all__ = ["BindError", "Source", "StepError", "generate", "skeleton"]
