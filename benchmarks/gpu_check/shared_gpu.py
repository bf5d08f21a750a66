"""Section 2: two processes on ONE GPU whose collectives go through gloo (`train.backend: gloo`), fp32 with TF32
off: DP, ZeRO 1-3, TP 2 with and without sequence parallelism, PP 2 (GPipe, 1F1B), expert parallelism 2 (the
preset with a MoE block in every layer: tokens to the other rank's experts by all-to-all, ZeRO-2 beside the
experts' own strategy), and a checkpoint saved and loaded into a fresh engine. Each layout's losses must
equal a one-process fp32 run on the same GPU of the same global batch (torch's own loop) within rtol 1e-4.

SGD with momentum and no clipping: Adam divides every gradient by its own magnitude and clipping rescales the
whole gradient, so both would hide a uniform gradient-scale error (a mean taken over the wrong count of ranks
or micro-batches); SGD's step is proportional to the gradient, so such an error shows in the next loss.

gloo reads host memory, so bunsan.comm.Comm copies each device tensor to the host and back inside the
collective, never in bunsan's step; and Comm checks every tensor it is handed is on the rank's device (a host
tensor raises DeviceError: on NCCL it would be a crash or a hang). `engine.comm.tensors_checked` counts the
checked tensors: every row reports it (it must be > 0). In a dry run the two ranks are CPU processes on gloo.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from .common import REPO, Section, begin, build_model, check, compare_losses, reference_losses, token_batches

WORLD = 2
RTOL = 1e-4
LR, MOMENTUM = 0.05, 0.9

# row -> config sections for its layout (on top of the base: SGD, fp32, gloo, TF32 off)
LAYOUTS = {
    "gloo dp (zero0)": {},
    "gloo zero1": {"zero_optimization": {"stage": 1}},
    "gloo zero2": {"zero_optimization": {"stage": 2}},
    "gloo zero3": {"zero_optimization": {"stage": 3}},
    "gloo tp2": {"tensor_parallel": {"size": 2}},
    "gloo tp2 sp": {"tensor_parallel": {"size": 2, "sequence_parallel": True}},
    "gloo pp2 gpipe": {"pipeline": {"stages": 2, "schedule": "gpipe"}},
    "gloo pp2 1f1b": {"pipeline": {"stages": 2, "schedule": "1f1b"}},
    "gloo ep2 moe zero2": {"expert_parallel": {"enabled": True, "autoep_size": 2},
                           "zero_optimization": {"stage": 2}},
    "gloo zero3 checkpoint save/load": {"zero_optimization": {"stage": 3}},
}
CHECKPOINT_ROW = "gloo zero3 checkpoint save/load"
# rows whose model has a MoE block in every layer: dropless and without a balancing loss, so each token's
# routing is its own and the whole-batch plain loop is the reference
MOE = {"num_experts": 4, "top_k": 2, "expert_intermediate_size": 64, "route_norm": True}
MOE_ROWS = {"gloo ep2 moe zero2"}


def model_for(name: str, sz, seed: int = 0):
    return build_model(sz.preset, seed=seed, **sz.model, **({"moe": MOE} if name in MOE_ROWS else {}))


def config(extra: dict, sz) -> dict:
    grad_accum = 2                   # >= the pipeline's stages; also exercises accumulation in DP and ZeRO
    dp = WORLD // (extra.get("tensor_parallel", {}).get("size", 1) * extra.get("pipeline", {}).get("stages", 1))
    return {"train_micro_batch_size_per_gpu": sz.rows // (dp * grad_accum), "gradient_accumulation_steps": grad_accum,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}}, "gradient_clipping": 0.0,
            "data": {"seq_len": sz.seq},
            "train": {"backend": "gloo", "tf32": False, "timeout_s": 60.0, "seed": 1234}, **extra}


# -- on each rank -----------------------------------------------------------------------------------------
def _train(rank: int, name: str, sz, ckpt_dir: str | None) -> dict:
    import torch

    import bunsan
    from bunsan.comm.collectives import DeviceError

    from .common import rank_slice
    extra = LAYOUTS[name]
    cfg = config(extra, sz)
    data = token_batches(sz.steps, sz.rows, sz.seq)
    engine = bunsan.initialize(model_for(name, sz), cfg)
    out = {"device": str(engine.device), "rank": engine.mesh.rank, "dp": engine.dp_size, "tp": engine.tp_size,
           "pp": engine.pp_size, "ep": engine.mesh.ep}

    def step(e, batch):
        try:
            return e.train_batch(rank_slice(batch, e.dp_rank, e.dp_size))
        except DeviceError as err:     # named apart: the one failure this section exists to catch
            raise RuntimeError(f"DeviceError: {err}") from err

    if name != CHECKPOINT_ROW:
        out["losses"] = [step(engine, b) for b in data]
        out["tensors_checked"] = engine.comm.tensors_checked
        out["backend"] = str(torch.distributed.get_backend())
        return out
    # train to the last step, save, take the last step; then a fresh engine from other weights loads the
    # checkpoint and takes the same last step
    out["losses"] = [step(engine, b) for b in data[:-1]]
    engine.save_checkpoint(ckpt_dir, tag="gpu-check")
    out["losses"].append(step(engine, data[-1]))
    checked = engine.comm.tensors_checked
    del engine
    fresh = bunsan.initialize(build_model(sz.preset, seed=7, **sz.model), cfg)
    fresh.load_checkpoint(ckpt_dir, tag="gpu-check")
    out["resumed_loss"] = step(fresh, data[-1])
    out["resumed_step"] = fresh.global_step
    out["tensors_checked"] = checked + fresh.comm.tensors_checked
    out["backend"] = str(torch.distributed.get_backend())
    return out


def _ranks(dry_run: bool):
    """Two spawned ranks (tests/dist_harness.py's pool) that take one row at a time; bunsan.initialize makes
    their process group (gloo, from the environment) at the first row and reuses it after."""
    import sys
    sys.path.insert(0, str(REPO / "tests"))
    from dist_harness import Pool
    return Pool(WORLD, make_group=False, threads=1 if dry_run else 4)   # two ranks share the cores


def main(section: Section) -> None:
    import torch

    dry = section.dry_run
    sz, dev, data = begin(section, LAYOUTS)
    if dev.type == "cuda":    # the reference in fp32 on the same GPU, TF32 off as in the ranks
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    sgd = lambda p: torch.optim.SGD(p, lr=LR, momentum=MOMENTUM)     # noqa: E731
    reference = reference_losses(build_model(sz.preset, seed=0, **sz.model), data, sgd, dev)
    moe_reference = reference_losses(model_for(next(iter(MOE_ROWS)), sz), data, sgd, dev)
    state = {"ranks": None}
    tmp = tempfile.mkdtemp(prefix="bunsan-gpu-check-ckpt-")

    def run(row, name):
        if state["ranks"] is None:
            state["ranks"] = _ranks(dry)
        try:
            results = state["ranks"].run(_train, name, sz, os.path.join(tmp, "ckpt"),
                                         timeout=max(1.0, section.left() - 3))
        except BaseException:     # a failed row leaves the group in an unknown state: new ranks for the next
            state["ranks"].close(force=True)
            state["ranks"] = None
            raise
        first = results[0]
        row.numbers.update(world=WORLD, backend=first["backend"], devices=sorted({r["device"] for r in results}),
                           layout={k: first[k] for k in ("dp", "tp", "pp", "ep")}, preset=sz.preset, seq=sz.seq,
                           batch=sz.rows, tensors_checked=[r["tensors_checked"] for r in results])
        check(first["backend"] == "gloo", f"the ranks' process group is {first['backend']}, not gloo")
        if dev.type == "cuda":
            check(all(r["device"].startswith("cuda") for r in results),
                  f"ranks ran on {[r['device'] for r in results]}, expected both on the GPU")
        check(min(r["tensors_checked"] for r in results) > 0,
              f"Comm checked {row.numbers['tensors_checked']} tensors: the device check did not run")
        for r in results[1:]:
            check(r["losses"] == first["losses"], f"ranks disagree on the losses: {[x['losses'] for x in results]}")
        compare_losses(row, first["losses"], moe_reference if name in MOE_ROWS else reference, RTOL,
                       "1-process fp32 on " + dev.type)
        row.headline += f"; tensors checked {row.numbers['tensors_checked']}"
        if name == CHECKPOINT_ROW:
            resumed, continued = first["resumed_loss"], first["losses"][-1]
            rel = abs(resumed - continued) / abs(continued)
            row.numbers.update(resumed_loss=resumed, continued_loss=continued, resumed_rel_diff=float(f"{rel:.3g}"),
                               resumed_step=first["resumed_step"])
            row.headline += f"; after load {resumed:.6f} vs {continued:.6f} uninterrupted"
            check(rel <= 1e-5, f"the step after loading the checkpoint gives loss {resumed!r}, the uninterrupted "
                               f"run {continued!r} (rel diff {rel:.2e} > 1e-5)")
            check(first["resumed_step"] == sz.steps, f"global_step {first['resumed_step']} after the resumed step, "
                                                     f"expected {sz.steps}")

    try:
        for name in LAYOUTS:
            section.run(name, run, 8.0, name)
    finally:
        if state["ranks"] is not None:
            state["ranks"].close()
        shutil.rmtree(tmp, ignore_errors=True)
