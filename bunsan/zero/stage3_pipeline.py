"""ZeRO-3 under pipeline stages (the mixin of stage3.FullyShardedDP): the pipeline runtime calls a stage's
blocks, not the stage module, so the root unit's hooks never run and the schedule says when to gather it.

    begin_schedule         the root unit gathered for the whole schedule; with stage3_pipeline_gather
                           "schedule" the blocks too (one gather per step, the stage whole through it), else
                           each block gathered by its hooks per micro-batch, in forward and again in backward
    after_backward_piece   the piece's blocks released (the next micro-batch gathers them again)
    end_schedule           the whole gradients reduce-scattered once (schedule_grads.py), everything released
"""

from __future__ import annotations

import contextlib

from bunsan.zero.schedule_grads import ScheduleGrads

__all__ = ["PipelineSchedule"]


class PipelineSchedule:
    def begin_schedule(self) -> None:
        """The root unit (this stage's embedding, norm or head) stays gathered through the schedule; the blocks
        too with stage3_pipeline_gather "schedule", else each is gathered by its hooks per micro-batch. The
        gradients accumulate whole (zero/schedule_grads.py), reduced once after the schedule."""
        if self.schedule_grads is None:
            self.schedule_grads = ScheduleGrads(self.layout, self._param_shapes, self.dtype, self.device)
        self.schedule_grads.attach(self.params)
        self.gather(self._root)
        if self.zero.stage3_pipeline_gather == "schedule":
            for k in range(len(self.units)):
                self.gather(k)
            self.holding = True

    def after_backward_piece(self) -> None:
        # The piece's blocks are done with for this micro-batch: released (the next one gathers them again).
        for k, u in enumerate(self.units):
            u.in_backward = False
            if k != self._root:
                self.release(k)

    def end_schedule(self) -> None:
        self.holding = False
        for u in self.units:     # a prefetch the schedule never used (the weights have not changed since)
            if u.pending is not None:
                u.pending.wait()
                u.pending, u.gathered = None, True
        self.schedule_grads.reduce_and_drop(self.params, self.reducer)   # each unit released as it goes
        for k, u in enumerate(self.units):
            u.in_backward = False
            self.release(k)

    @contextlib.contextmanager
    def pipeline_evaluation(self):
        self.gather(self._root)
        try:
            yield
        finally:
            self.release(self._root)

