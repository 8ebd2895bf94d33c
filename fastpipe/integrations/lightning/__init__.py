"""Lightning's ``Trainer`` on a pipeline: ``PipelineStrategy``, ``training_loss``, ``evaluate``.

The contract for a ``LightningModule`` (the same module runs under Lightning's own strategies):

- the model it trains is one attribute, ``self.model`` (``PipelineStrategy(attribute=...)``
  for another), holding every trained parameter; ``configure_optimizers`` builds one optimizer
  on ``self.parameters()``;
- ``training_step`` computes its loss with ``training_loss(self.model, inputs, targets,
  loss_fn)`` (or ``training_loss(self.model, batch)`` for a model that computes its own loss
  from labels in the batch), logs it as it likes and returns it;
- ``validation_step`` / ``test_step`` compute what they log with ``evaluate(self.model,
  inputs, targets, metric_fn)``;
- the split, the micro-batches and the schedule are the strategy's arguments
  (``PipelineStrategy(chunks=4, split_points=[...], example_inputs=batch, ...)``).

Importing this module needs Lightning (``pip install 'fastpipe[lightning]'``).
"""
from .. import require

require("lightning.pytorch", "lightning")  # an ImportError naming the extra, before any import

from .steps import evaluate, training_loss  # noqa: E402
from .strategy import PipelineStrategy  # noqa: E402

__all__ = ["PipelineStrategy", "evaluate", "training_loss"]
