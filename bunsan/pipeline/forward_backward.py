"""Forward and backward of a step's micro-batches through the pipeline: what the engine's step calls in place
of its plain micro-batch loop (the step itself, its loss and its optimizer boundary, stay the engine's).

The data-parallel strategy (any ZeRO stage) is told to accumulate through the whole
schedule and reduce once after it: a pipeline's backward comes in pieces (one per
micro-batch and chunk), so bucket hooks cannot tell when a gradient is final.
ZeRO-3 gathers a stage's blocks per micro-batch or once per schedule
(zero_optimization.stage3_pipeline_gather; zero/stage3.py).
Before that reduction, weights tied across stages (a Llama's embedding and head)
sum their gradients over the stages that hold them.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn


def forward_backward(pipe, micro: list, objective, dp, module: nn.Module,
                     on_phase: Callable[[str], None]) -> torch.Tensor:
    """Run the schedule over `micro` and reduce the gradients; this data-parallel rank's summed loss, a device
    tensor on every stage. `on_phase` names what runs, for the doctor's out-of-memory advice."""
    comm, group = pipe.comm, pipe.group
    # The stages start together: the timeline's clocks align here, and under NCCL this collective is what the
    # group's first batched send/receive needs before it.
    comm.barrier(group)
    pipe.recorder.begin()
    dp.begin_schedule()
    on_phase(f"pipeline schedule ({pipe.schedule}, {len(micro)} micro-batches)")
    total = pipe.runner.train(micro, objective.first_input, objective, objective.seq_len,
                              after_backward=dp.after_backward_piece)
    on_phase("gradient reduction after the pipeline schedule")
    with pipe.recorder.record("sync", -1, 0):
        for name, tied_group in pipe.tied:
            grad = module.get_parameter(name).grad
            if grad is not None and tied_group is not None:
                comm.all_reduce(grad, tied_group)
        dp.end_schedule()     # every bucket reduced now, in order
    # The loss lives on the last stage: hand it to every stage (the data-parallel sum is the engine's).
    comm.broadcast(total, pipe.p - 1, group)
    return total


@torch.no_grad()
def forward(pipe, micro: list, objective) -> torch.Tensor:
    """Evaluation: the summed loss of `micro` run forward through the stages, on every stage."""
    loss_of = lambda out, mb: (None, objective.summed(out, mb))   # noqa: E731  (nothing to backpropagate)
    total = pipe.runner.evaluate(micro, objective.first_input, loss_of, objective.seq_len)
    pipe.comm.broadcast(total, pipe.p - 1, pipe.group)
    return total
