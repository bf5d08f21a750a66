"""Section 1: world size 1 on the GPU in bf16 (and fp16), every ZeRO stage, offload, checkpointing and LoRA,
each against a CPU fp32 run of the same steps from the same initial weights.

bunsan keeps fp32 master weights and steps them with fp32 optimizer states whatever the model's dtype, so a
16-bit run follows the fp32 one up to the 16-bit rounding of the forward and backward: the losses agree within
rtol 3e-2 over a few steps, and the batches are learnable so that the loss moves by more than that (a step that
did nothing, or twice, shows). The reference is torch's own loop on the CPU, not bunsan.
"""

from __future__ import annotations

import tempfile

from .common import Section, begin, build_model, check, clone, compare_losses, free_memory, reference_losses

RTOL_16BIT = 3e-2
LR = 1e-3          # AdamW; on token_batches the fp32 loss falls 20-35% in 3-4 steps, smoothly
LORA_LR = 3e-3     # adapters start at B = 0 and move the loss more slowly
DRY_LORA_LR = 1e-2     # the dry run's two-layer model: at 3e-3 its loss moves within the tolerance in 3 steps

# row -> (precision, config sections on top of the base); ZeRO-3 NVMe offload gets its directory at run time
LAYOUTS = {
    "bf16 zero0": ("bf16", {}),
    "bf16 zero1": ("bf16", {"zero_optimization": {"stage": 1}}),
    "bf16 zero2": ("bf16", {"zero_optimization": {"stage": 2}}),
    "bf16 zero3": ("bf16", {"zero_optimization": {"stage": 3}}),
    "bf16 zero3 offload cpu": ("bf16", {"zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}),
    "bf16 zero3 offload nvme": ("bf16", {"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": None},
        "offload_optimizer": {"device": "nvme", "nvme_path": None}}}),
    "bf16 activation checkpointing": ("bf16", {"activation_checkpointing": {"enabled": True}}),
    "bf16 lora": ("bf16", {"lora": {"enabled": True, "r": 8, "alpha": 16.0,
                                    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"]}}),
    # the dynamic scaler from a lower start than DeepSpeed's 2^16, so that a few steps are not all spent
    # finding the scale (skipped steps are replayed as skipped by the reference, and counted)
    "fp16 dynamic loss scale": ("fp16", {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                                                  "loss_scale_window": 2}}),
}


def lr(name: str, dry: bool = False) -> float:
    return (DRY_LORA_LR if dry else LORA_LR) if "lora" in LAYOUTS[name][1] else LR


def config(name: str, sz, nvme_dir: str | None = None, dry: bool = False) -> dict:
    precision, extra = LAYOUTS[name]
    cfg = {"train_micro_batch_size_per_gpu": sz.rows // 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": lr(name, dry), "weight_decay": 0.0}},
           "data": {"seq_len": sz.seq}, "train": {"seed": 1234}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    for key, section in extra.items():
        section = {k: (dict(v, nvme_path=nvme_dir) if isinstance(v, dict) and "nvme_path" in v else v)
                   for k, v in section.items()}
        cfg[key] = section
    return cfg


def adamw(rate: float):
    import torch
    return lambda params: torch.optim.AdamW(params, lr=rate, weight_decay=0.0)


def main(section: Section) -> None:
    import torch

    import bunsan
    from bunsan.config.root import Config
    from bunsan.comm.process_group import backend_name
    from bunsan.transforms.lora import apply_lora

    sz, dev, data = begin(section, LAYOUTS)
    dry = section.dry_run
    base = build_model(sz.preset, seed=0, **sz.model)
    cpu = torch.device("cpu")
    reference = reference_losses(clone(base), data, adamw(LR), cpu)

    ran: dict[str, list] = {}       # row -> its losses (the offload_states row's reference)

    def run(row, name):
        with tempfile.TemporaryDirectory(prefix="bunsan-gpu-check-nvme-") as nvme:
            cfg = config(name, sz, nvme, dry)
            model = clone(base)
            ref_model = clone(base)
            if cfg.get("lora", {}).get("enabled"):    # the reference gets the same adapters, drawn the same way
                parsed = Config.load(cfg)
                apply_lora(ref_model, parsed.lora, parsed.train.seed)
            engine = bunsan.initialize(model, cfg)
            check(engine.device.type == dev.type, f"engine on {engine.device}, expected {dev}")
            losses, skipped = [], []
            for batch in data:
                before = engine.skipped_steps
                losses.append(engine.train_batch(batch))
                skipped.append(engine.skipped_steps > before)
            row.numbers.update(device=str(engine.device), dtype=str(engine.dtype).removeprefix("torch."),
                               backend=backend_name(), preset=sz.preset, seq=sz.seq, batch=sz.rows, steps=len(data))
            if engine.scaler is not None:
                row.numbers.update(loss_scale=engine.loss_scale, skipped_steps=sum(skipped))
                check(sum(skipped) < len(data) - 1, f"the loss scaler skipped {sum(skipped)} of {len(data)} steps")
            if dev.type == "cuda":
                mem = engine.memory_report()
                row.numbers.update(cuda_peak_allocated=mem.get("cuda_peak_allocated"),
                                   host_bytes=mem.get("host"), disk_bytes=mem.get("disk"))
            want = reference
            if any(skipped) or cfg.get("lora", {}).get("enabled"):     # a reference of its own
                want = reference_losses(ref_model, data, adamw(lr(name, dry)), cpu, skip=skipped)
            compare_losses(row, losses, want, RTOL_16BIT, "CPU fp32")
            ran[name] = losses
            if engine.scaler is not None:
                row.headline += f"; loss scale {engine.loss_scale:g}, {sum(skipped)} step(s) skipped (replayed)"
            del engine, model
            free_memory()

    def offload_states(row, name):
        """DeepSpeed's engine.offload_states() frees the states' device memory, reload_states() brings them back
        bit for bit: the same run with a round trip after step 1 has the same losses as the row without."""
        import bunsan.deepspeed as deepspeed
        losses, moved = {}, {}
        if name in ran:
            losses[False] = ran[name]
        for round_trip in (False, True) if name not in ran else (True,):
            engine, *_ = deepspeed.initialize(model=clone(base), config=config(name, sz, dry=dry))
            got = []
            for k, batch in enumerate(data):
                got.append(engine.bunsan.train_batch(batch))
                if round_trip and k == 0:
                    before = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
                    engine.offload_states()
                    parked = engine._parked.nbytes()
                    moved = {"states_bytes": parked, "allocated_before": before,
                             "allocated_offloaded": torch.cuda.memory_allocated() if dev.type == "cuda" else 0}
                    engine.reload_states()
            losses[round_trip] = got
            del engine
            free_memory()
        row.numbers.update(moved)
        compare_losses(row, losses[True], losses[False], 0.0, "the same run without the round trip")  # bit for bit
        if dev.type != "cuda":
            row.headline += " (on the CPU nothing moves)"
        if dev.type == "cuda":
            check(moved["states_bytes"] > 0, "offload_states moved nothing")
            freed = moved["allocated_before"] - moved["allocated_offloaded"]
            check(freed >= moved["states_bytes"], f"{freed} bytes freed for {moved['states_bytes']} offloaded")
            row.headline = f"{moved['states_bytes'] / 2 ** 20:.0f} MiB off the GPU and back, losses equal"

    for name in LAYOUTS:
        section.run(name, run, 5.0, name)
    section.run("offload_states zero3 (DeepSpeed's)", offload_states, 5.0, "bf16 zero3")
