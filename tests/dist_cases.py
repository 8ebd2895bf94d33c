"""Test cases run by every rank of a gloo process group (started by ``dist_launch.launch``).

Each case builds the plain model with the same seed on every rank, computes the reference loss
and gradients in-process, runs the pipeline, and raises (non-zero exit) on any mismatch; on
success it prints one ``RESULT <json>`` line. The cases live in modules by what they test
(``dist_pipeline_cases``, ``dist_model_cases``, ``dist_failure_cases``, ``dist_state_cases``,
``dist_schedule_cases``, ``dist_three_d_cases``; shared helpers in ``dist_common``); this
entry point gathers them into ``CASES`` and runs the one named on the command line. It
re-exports the shared helpers for case files that import them from here.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_common import (P2P, TOL, WIDTH, DistributedPipe, check_full_grads,  # noqa: E402, F401
                         check_grads, data, full, main, model, padded, reference_grads,
                         skip_model, tied_model, token_loss, token_mean_of, tp_plan)
from dist_failure_cases import (bad_targets, blame, boundary_mismatch,  # noqa: E402
                                detached_loss, failure)
from dist_host_read_cases import host_reads, refused_count  # noqa: E402
from dist_model_cases import (autocast_bf16, compat, deferred_batch_norm,  # noqa: E402
                              evaluate, grad_scaler, skip_connections, tied_weights,
                              traced_gpt2)
from dist_pipeline_cases import (data_parallel, loss_checks, process_groups,  # noqa: E402
                                 randomized, token_mean, transparency, variable_shapes)
from dist_schedule_cases import (auto_chunks, auto_schedule, doctored, pipedream,  # noqa: E402
                                 traced)
from dist_state_cases import (checkpoint_across_layouts, dcp_round_trip,  # noqa: E402
                              meta_and_factories)
from dist_three_d_cases import (three_d, three_d_checkpoint, three_d_errors,  # noqa: E402
                                three_d_pipedream, three_d_runs, three_d_token_mean)

from fastpipe.distributed import init_mesh  # noqa: E402, F401


def several(cases: List[List[Any]]) -> Dict:
    """Run several cases in the same processes (saves a start-up per case)."""
    return {name: CASES[name](**args) for name, args in cases}


CASES = {f.__name__: f for f in (process_groups, randomized, transparency, data_parallel,
                                 variable_shapes, failure, blame, loss_checks, detached_loss,
                                 traced_gpt2, token_mean, dcp_round_trip, bad_targets,
                                 boundary_mismatch, checkpoint_across_layouts, auto_chunks,
                                 auto_schedule, traced, doctored, pipedream,
                                 meta_and_factories, tied_weights, deferred_batch_norm,
                                 grad_scaler, autocast_bf16, skip_connections, compat, evaluate,
                                 several)}
CASES.update({f.__name__: f for f in (host_reads, refused_count)})
CASES.update({f.__name__: f for f in (three_d, three_d_runs, three_d_checkpoint,
                                      three_d_errors, three_d_pipedream, three_d_token_mean)})


if __name__ == "__main__":
    main(CASES)
