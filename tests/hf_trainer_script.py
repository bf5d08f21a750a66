"""transformers' Trainer as its users write it, with or without `deepspeed=`; run by test_hf_trainer.py.

    python hf_trainer_script.py OUT.json none|STAGE hf|config adamw|sgd [CONFIG.json | save RUN | resume RUN]
                                [gas=N] [dtype=bf16]

With a stage, `bunsan.deepspeed.install()` comes first: the one line that makes the Trainer's DeepSpeed bunsan.
`hf`: the Trainer builds the optimizer and its linear schedule; `config`: the DeepSpeed config's optimizer with
"auto" values (the Trainer fills them), and the Trainer's schedule over it. `save RUN`: 3 steps, saved in RUN;
`resume RUN`: a later run resumes from RUN/checkpoint-3 (weights, optimizer, schedule) into a model of other
weights, steps 4-5. Writes the logged losses to OUT.

`gas=N` (gradient accumulation, "auto" in the config): two epochs of 5 micro-batches each, so that an epoch's
last accumulation is shorter (the boundary the Trainer sets, through accelerate, at the epoch's end);
`save`/`resume` then stop and resume after the first half of the steps plus one (in the second epoch).
`eval=1`: an evaluation every 2 steps. `plugin=1`: no `deepspeed=` in TrainingArguments, the DeepSpeed config
is accelerate's plugin (`accelerate launch` with `distributed_type: DEEPSPEED`). `dtype=bf16`:
TrainingArguments(bf16=True), the config's bf16 "auto".

`rank_job` runs the same `main` as a job of tests/dist_harness.py's ranks (torchrun's environment, a gloo group
already made), so that a test pays for no launch where the launch is not what it checks.
"""

import json
import os
import sys


def main(argv: list[str]) -> dict | None:
    out_path, stage, source, optim = argv[:4]
    extra = [a for a in argv[4:] if "=" not in a]
    opts = dict(a.split("=", 1) for a in argv[4:] if "=" in a)
    gas = int(opts.get("gas", 1))
    bf16 = opts.get("dtype") == "bf16"
    epochs = "gas" in opts          # the accumulation form: whole epochs, evaluation, an uneven last step
    if stage != "none":
        import bunsan.deepspeed
        bunsan.deepspeed.install()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, rows: int = 48, seed: int = 0):
            self.ids = torch.randint(0, 128, (rows, 16), generator=torch.Generator().manual_seed(seed))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    ds_config = None
    if stage != "none" and opts.get("plugin") != "1":
        ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                     "gradient_clipping": "auto", "zero_optimization": {"stage": int(stage)}}
        if bf16:
            ds_config["bf16"] = {"enabled": "auto"}
        if source == "config":
            ds_config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                                  "weight_decay": "auto"}}
        if extra and extra[0] not in ("save", "resume"):   # the usual form: a path to the JSON file
            with open(extra[0], "w") as f:
                json.dump(ds_config, f)
            ds_config = extra[0]
    args = TrainingArguments(
        output_dir=out_path + ".run", per_device_train_batch_size=4, max_steps=5,
        learning_rate=5e-2 if optim == "sgd" else 1e-2, weight_decay=0.01, logging_steps=1, save_strategy="no",
        report_to=[], deepspeed=ds_config, use_cpu=stage == "none", seed=0, lr_scheduler_type="linear",
        max_grad_norm=0.0 if optim == "sgd" else 1.0, optim="sgd" if optim == "sgd" else "adamw_torch",
        dataloader_drop_last=True, gradient_accumulation_steps=gas, bf16=bf16)
    if epochs:   # 20 rows in micro-batches of 4: 5 a epoch, which no accumulation above 1 divides
        args.max_steps, args.num_train_epochs = -1, 2
    if opts.get("eval") == "1":
        args.eval_strategy, args.eval_steps, args.per_device_eval_batch_size = "steps", 2, 4
    total = 2 * -(-5 // gas) if epochs else 5
    stop_at = total // 2 + 1 if epochs else 3
    phase = extra[0] if extra and extra[0] in ("save", "resume") else None
    if phase is not None:
        args.output_dir, args.save_strategy, args.save_steps = extra[1], "steps", stop_at

    class StopPartWay(TrainerCallback):   # the run is stopped, as a preempted job is; the schedule is all steps'
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == stop_at

    if phase == "resume":
        torch.manual_seed(123)                  # other weights: every weight must come from the checkpoint
        model = LlamaForCausalLM(model.config)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(20) if epochs else Tokens(),
                      eval_dataset=Tokens(8, seed=1) if opts.get("eval") == "1" else None,
                      callbacks=[StopPartWay()] if phase == "save" else None)
    trainer.train(resume_from_checkpoint=f"{extra[1]}/checkpoint-{stop_at}" if phase == "resume" else None)
    if args.process_index != 0:
        return None
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result = {"losses": logged, "lrs": [h["learning_rate"] for h in trainer.state.log_history if "loss" in h],
              "steps": [h["step"] for h in trainer.state.log_history if "loss" in h],
              "eval_losses": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h],
              "processes": trainer.accelerator.num_processes}
    with open(out_path, "w") as f:
        json.dump(result, f)
    return result


# What the launch gives the script's process, set for one job and undone after it: the ranks serve other tests.
JOB_ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "TRANSFORMERS_VERBOSITY": "error"}
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def rank_job(rank: int, argv: list[str]) -> dict | None:
    """`main(argv)` on a harness rank as torchrun's worker runs the script; with stage `none`, as `python
    script.py` runs it (no torchrun environment: one process). The environment and the accelerate state the
    Trainer leaves are undone after, for the rank's next job."""
    saved = dict(os.environ)
    os.environ.update(JOB_ENV)
    if argv[1] == "none":
        for key in TORCHRUN_ENV:
            os.environ.pop(key, None)
    try:
        return main(argv)
    finally:
        from accelerate.state import AcceleratorState     # (imported after main's install(), as the script does)
        AcceleratorState._reset_state(reset_partial_state=True)
        os.environ.clear()
        os.environ.update(saved)


if __name__ == "__main__":
    main(sys.argv[1:])
