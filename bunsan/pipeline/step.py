"""One optimizer step of a pipelined engine: the schedule, then the gradient reductions, then the step.

The engine's data-parallel strategy (ZeRO 0 or 1) is told to accumulate through
the whole schedule and reduce once after it: a pipeline's backward comes in
pieces (one per micro-batch and chunk), so bucket hooks cannot tell when a
gradient is final. Before that reduction, weights tied across stages (a Llama's
embedding and head) sum their gradients over the stages that hold them.
"""

from __future__ import annotations

import torch


def _inputs(engine, lm: bool, div: float):
    """(first-stage input, loss and reported loss, sequence length) for dict LM batches or (x..., y) tuples."""
    scale = engine.scaler.scale if engine.scaler else 1.0

    if lm:
        def loss_of(out, mb):
            total = engine._lm_loss_sum(out, mb["labels"])
            return (total / div) * scale, total
        return (lambda mb: mb["input_ids"]), loss_of, (lambda mb: mb["input_ids"].shape[1])

    def loss_of_fn(out, mb):
        loss = engine.loss_fn(out, mb[-1])
        return (loss / div) * scale, loss
    return (lambda mb: mb[0]), loss_of_fn, (lambda mb: 0)


def train_batch(engine, micro: list, lm: bool, div: float) -> float:
    """Run the schedule over `micro`, reduce, step; return the global mean loss (on every rank)."""
    pipe, mesh, comm = engine.pipe, engine.mesh, engine.comm
    first_input, loss_of, seq_len = _inputs(engine, lm, div)
    if engine.loss_fn is None and not lm:
        raise ValueError("pass loss_fn to bunsan.initialize for batches that are not language-model dicts")
    comm.barrier(mesh.pp_group)          # the timeline's clocks start together on every stage
    pipe.recorder.begin()
    engine.dp.begin_backward(sync=False)
    engine.phase = f"pipeline schedule ({pipe.schedule}, {len(micro)} micro-batches)"   # for the doctor
    total = pipe.runner.train(micro, first_input, loss_of, seq_len)
    engine.phase = "gradient reduction after the pipeline schedule"
    with pipe.recorder.record("sync", -1, 0):
        for name, group in pipe.tied:
            grad = engine.module.get_parameter(name).grad
            if grad is not None and group is not None:
                comm.all_reduce(grad, group)
        engine.dp.begin_backward(sync=True)     # every bucket reduced now, in order
        engine.dp.end_backward(sync=True)
    # The loss lives on the last stage: hand it to every stage, then sum over data-parallel ranks.
    last = pipe.p - 1
    t = total.reshape(1).clone()
    comm.broadcast(t, last, mesh.pp_group)
    reported = comm.all_reduce_scalars([t.item()], mesh.dp_group)[0]
    engine.micro_steps = 0
    engine._optimizer_step()
    return reported / (div if lm else engine.grad_accum * mesh.dp)


@torch.no_grad()
def eval_batch(engine, batch) -> float:
    """Mean loss of a per-rank batch run forward through the stages, cut into up to grad_accum micro-batches."""
    pipe, mesh, comm = engine.pipe, engine.mesh, engine.comm
    lm = isinstance(batch, dict) and engine.loss_fn is None
    tensors = {k: v.to(engine.device) for k, v in batch.items()} if isinstance(batch, dict) \
        else tuple(t.to(engine.device) for t in batch)
    rows = next(iter(tensors.values() if isinstance(tensors, dict) else tensors)).shape[0]
    pieces = max(1, min(rows, engine.grad_accum))
    if isinstance(tensors, dict):
        chunks = {k: v.chunk(pieces) for k, v in tensors.items()}
        micro = [{k: c[i] for k, c in chunks.items()} for i in range(len(next(iter(chunks.values()))))]
    else:
        chunks = [t.chunk(pieces) for t in tensors]
        micro = [tuple(c[i] for c in chunks) for i in range(len(chunks[0]))]
    first_input, loss_of, seq_len = _inputs(engine, lm, 1.0)
    if lm:
        count = float((tensors["labels"] != -100).sum())
    else:   # loss_fn gives a mean per micro-batch: weight it by its rows
        count, mean_of = float(rows), loss_of
        loss_of = lambda out, mb: (None, mean_of(out, mb)[1] * mb[0].shape[0])   # noqa: E731
    total = pipe.runner.evaluate(micro, first_input, loss_of, seq_len)
    t = total.reshape(1).clone()
    comm.broadcast(t, pipe.p - 1, mesh.pp_group)
    s, n = comm.all_reduce_scalars([t.item(), count], mesh.dp_group)
    return s / n
