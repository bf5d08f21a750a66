"""bunsan's own sections, which DeepSpeed has no counterpart for: tensor, context and pipeline parallelism, LoRA, the
model `bunsan train` builds, its data, checkpoints and run. DeepSpeed's sections are in sections.py."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from bunsan.config.errors import Rule
from bunsan.config.sections import Backend, GlooCollectives, Int, OptInt, Partition, Schedule, Section


class Lora(Section):
    """Low-rank adapters (peft) on the named linear layers; the base weights are frozen."""
    enabled: bool = Field(False, description="Train low-rank adapters on lora.target_modules, base weights frozen "
                                             "(needs peft); saved as lora.save says")
    r: Int = Field(8, ge=1, description="Rank of each adapter (its inner dimension)")
    alpha: float = Field(16.0, gt=0, description="Adapter scale: the low-rank update is multiplied by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout probability on each adapter's input")
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                      description="Names of the linear layers that get adapters (peft's "
                                                  "target_modules)")
    save: Literal["merged", "adapter", "both"] = Field("merged", description="bunsan train's output: the model "
                                                       "with the adapters merged (final/), peft's adapter (adapter/), or both")

    @model_validator(mode="after")
    def _targets(self) -> Lora:
        if self.enabled and not self.target_modules:
            raise Rule(("target_modules", "is empty, so no layer would get an adapter and nothing would train; "
                                          "name the linear layers, e.g. [\"q_proj\", \"v_proj\"]"))
        return self


class TensorParallel(Section):
    """bunsan: Megatron-style tensor parallelism inside each transformer block."""
    size: Int = Field(1, ge=1, description="Ranks each block's attention and MLP are split over; the rest of the "
                                           "world is data and pipeline parallel")
    sequence_parallel: bool = Field(False, description="Also shard the activations between blocks along the "
                                                       "sequence over the tensor-parallel ranks; needs size > 1")
    encoders: Literal["split", "whole"] = Field("split", description="A vision-language model's CLIP or SigLIP "
                                                "tower: its blocks split over the ranks, or whole on every rank")

    @model_validator(mode="after")
    def _sp(self) -> TensorParallel:
        if self.sequence_parallel and self.size == 1:
            raise Rule(("sequence_parallel", "sequence parallelism splits activations across tensor-parallel "
                                             "ranks and needs size > 1, got size 1; set tensor_parallel.size to 2 "
                                             "or more, or set sequence_parallel to false"))
        return self


class ContextParallel(Section):
    """bunsan: context parallelism, each row's tokens split over ranks whose attention all-gathers K/V"""
    size: Int = Field(1, ge=1, description="Ranks each row's tokens are split over (2 x size balanced chunks; "
                                           "data.seq_len a multiple of 2 x size)")


# DeepSpeed AutoEP keys that inject expert parallelism into a model by name patterns and presets; bunsan's
# expert parallelism acts on its own MoE blocks (models/moe.py), whose routing the model's config sets
_AUTOEP_INJECTION = (
    "expert_tensor_parallel_size", "validate_folding_routing", "preset_model", "moe_layer_pattern",
    "expert_pattern", "router_pattern", "use_grouped_mm", "disable_triton_grouped_mm", "route_norm",
    "route_scale", "score_apply", "combine_impl", "num_expert_groups", "num_limited_groups", "score_func",
    "top_k", "load_balance_coeff", "routed_scaling_factor", "expert_w1", "expert_w2", "expert_w3",
    "num_experts_attr", "top_k_attr", "has_shared_experts", "shared_experts_pattern", "shared_experts_gate_pattern")


class ExpertParallel(Section):
    """Expert parallelism (DeepSpeed AutoEP's keys): each MoE block's experts split over autoep_size ranks"""
    enabled: bool = Field(False, description="Split the experts of bunsan's MoE blocks over autoep_size ranks")
    autoep_size: Int = Field(1, ge=1, description="Ranks each MoE block's experts are split over; divides the "
                                                  "data x context parallel ranks and the number of experts")

    @model_validator(mode="before")
    @classmethod
    def _injection(cls, data):
        if isinstance(data, dict):      # (a switched-off section keeps DeepSpeed's keys, as users' configs do)
            given = [k for k in _AUTOEP_INJECTION if k in data]
            if given and data.get("enabled") is True:
                raise Rule((given[0], f"DeepSpeed AutoEP's model injection keys ({', '.join(given)}) are not "
                                      "built: bunsan splits the experts of its own MoE blocks, whose routing the "
                                      "model config's moe section sets; keep only enabled and autoep_size"))
            data = {k: v for k, v in data.items() if k not in _AUTOEP_INJECTION}
        return data

    @property
    def size(self) -> int:
        return self.autoep_size if self.enabled else 1


class Pipeline(Section):
    """bunsan: pipeline parallelism over consecutive layers; its micro-batches are gradient_accumulation_steps."""
    stages: Int = Field(1, ge=1, description="Pipeline stages the layers are cut into, one rank each; needs at "
                                             "least this many micro-batches (gradient_accumulation_steps)")
    schedule: Schedule = Field("1f1b", description="Order of the micro-batches' forwards and backwards: gpipe, "
                                                   "1f1b or interleaved")
    virtual_stages: Int = Field(1, ge=1, description="Model chunks per pipeline rank; more than 1 needs the "
                                                     "interleaved schedule (Megatron's virtual pipeline)")
    partition: Partition = Field("uniform", description="How layers are cut into stages: uniform (blocks), "
                                                        "parameters (parameter counts) or balanced (matmul work)")

    @model_validator(mode="after")
    def _virtual(self) -> Pipeline:
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise Rule(("virtual_stages", f"virtual_stages {self.virtual_stages} needs the interleaved schedule, "
                                          f"got schedule '{self.schedule}'; set pipeline.schedule to 'interleaved' "
                                          f"or virtual_stages to 1"))
        return self


class ModelOverrides(Section):
    """bunsan: the Llama `bunsan train` builds, a preset and per-field overrides (None = the preset's)."""
    preset: str = Field("small", description="Model preset: tiny, small, 135m, 1b, llama3-8b/70b/405b, 7b, 13b, "
                                             "70b (llama-13b style names too)")
    vocab_size: OptInt = Field(None, ge=1, description="Vocabulary size in tokens; None = the tokenizer's (at "
                                                       "least it)")
    hidden_size: OptInt = Field(None, ge=1, description="Width of the residual stream; None = the preset's")
    intermediate_size: OptInt = Field(None, ge=1, description="Width of the MLP's hidden layer; None = the preset's")
    num_hidden_layers: OptInt = Field(None, ge=1, description="Transformer blocks; None = the preset's")
    num_attention_heads: OptInt = Field(None, ge=1, description="Query heads (must divide hidden_size unless "
                                                                "head_dim is given); None = the preset's")
    head_dim: OptInt = Field(None, ge=2, description="Width of one attention head (even); None = hidden_size / "
                                                     "num_attention_heads")
    num_key_value_heads: OptInt = Field(None, ge=1, description="Key/value heads, grouped-query attention (must "
                                                                "divide num_attention_heads); None = the preset's")
    max_position_embeddings: OptInt = Field(None, ge=1, description="Longest sequence in tokens (at least "
                                                                    "data.seq_len); None = the preset's")
    rms_norm_eps: Optional[float] = Field(None, gt=0, description="Epsilon of the RMS norms; None = the preset's")
    rope_theta: Optional[float] = Field(None, gt=0, description="Base of the rotary position embedding; None = the "
                                                                "preset's")
    tie_word_embeddings: Optional[bool] = Field(None, description="Share the embedding and output head weights; "
                                                                  "None = the preset's")

    @model_validator(mode="after")
    def _heads(self) -> ModelOverrides:
        h, a, k, problems = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, []
        if h and a and h % a and self.head_dim is None:
            problems.append(("hidden_size", f"hidden_size {h} is not divisible by num_attention_heads {a}; set "
                                            f"hidden_size to a multiple of {a} (e.g. {max(a, h // a * a)}) or give "
                                            "head_dim"))
        if self.head_dim and self.head_dim % 2:
            problems.append(("head_dim", f"head_dim {self.head_dim} is odd and rotary embeddings rotate pairs; set "
                                         f"an even head_dim (e.g. {self.head_dim + 1})"))
        if a and k and a % k:
            divisors = ", ".join(str(d) for d in range(1, a + 1) if a % d == 0)
            problems.append(("num_key_value_heads", f"num_attention_heads {a} is not divisible by "
                                                    f"num_key_value_heads {k}; set num_key_value_heads to one of {divisors}"))
        if problems:
            raise Rule(*problems)
        return self


# the record fields data.fields may rename (training/examples.py's DEFAULT_FIELDS, which a test keeps equal)
FIELD_ROLES = ("text", "prompt", "completion", "instruction", "input", "output", "messages", "role", "content",
               "chosen", "rejected")


class Data(Section):
    """bunsan: the text `bunsan train` tokenizes (once, cached) and batches."""
    paths: list[str] = Field(default_factory=list, description="Text files, directories or globs; [] = the built-in "
                                                               "corpus (Python's standard library source)")
    tokenizer: Optional[str] = Field(None, description="Path to a Hugging Face tokenizer.json; None = bytes (256 "
                                                       "tokens)")
    seq_len: Int = Field(256, ge=2, description="Tokens per training sample")
    num_workers: Int = Field(0, ge=0, description="DataLoader worker processes; 0 = batches are built in the "
                                                  "training process")
    pin_memory: bool = Field(False, description="Page-lock batches for faster host-to-GPU copies (CUDA only)")
    prefetch_factor: Int = Field(2, ge=1, description="Batches each worker prepares ahead (with num_workers > 0)")
    cache_dir: Optional[str] = Field(None, description="Directory of the tokenized corpus cache; None = "
                                                       "$BUNSAN_CACHE/tokens or ~/.cache/bunsan/tokens")
    max_bytes: OptInt = Field(None, ge=1, description="Read at most this many bytes of text; None = all")
    val_fraction: float = Field(0.01, ge=0, lt=0.5, description="Fraction of the tokens held out for the "
                                                                "validation loss")
    format: Literal["text", "prompt_completion", "instruction", "chat", "preference"] = Field(
        "text", description="text: plain files as one token stream; else records (JSONL/JSON/Parquet/datasets)")
    fields: dict[str, str] = Field(default_factory=dict, description="Record field names when they differ, e.g. "
                                   "{prompt: question, completion: answer} (training/examples.py)")
    tokenize_workers: Int = Field(1, ge=1, description="Records: processes that render and tokenize them (1: in "
                                                      "the training process)")
    train_on_prompt: bool = Field(False, description="Records: train on every token, not only the responses")
    on_bad_record: Literal["error", "skip"] = Field("error", description="Records: one that cannot be rendered stops "
                                                    "the run naming it (error), or is left out and counted (skip)")
    packing: bool = Field(False, description="Records: several examples per row, each attending only to itself "
                                             "(false: one per row, padded)")


class Checkpoint(Section):
    """bunsan: the sharded checkpoints `bunsan train` saves and resumes from."""
    dir: Optional[str] = Field(None, description="Where `bunsan train` saves checkpoints (and resumes from); None = "
                                                 "no checkpoints")
    save_interval: Int = Field(0, ge=0, description="Optimizer steps between saves; 0 = only at the end (with dir "
                                                    "set)")
    keep_last: Int = Field(3, ge=1, description="Whole checkpoints kept in dir; older ones are deleted")
    resume: bool = Field(True, description="`bunsan train` continues from the newest whole checkpoint in dir")
    load_optimizer_states: bool = Field(True, description="Resume the optimizer's states too; false: the weights "
                                                          "and counters alone (another optimizer, a fresh start)")

    @model_validator(mode="after")
    def _dir(self) -> Checkpoint:
        if self.save_interval and not self.dir:
            raise Rule(("save_interval", f"save_interval {self.save_interval} needs a directory to save into; "
                                         "set checkpoint.dir (e.g. runs/bunsan/checkpoints) or save_interval 0"))
        return self


class Dpo(Section):
    """bunsan: Direct Preference Optimization (train.objective dpo, Rafailov et al. 2023) on preference pairs."""
    beta: float = Field(0.1, gt=0, description="How far from the reference the policy may move: the loss is "
                                               "-log sigmoid(beta x the log-ratio margin)")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Probability that a pair's preference is "
                                   "flipped (conservative DPO); 0 = the plain loss")
    reference: Literal["initial", "records"] = Field("initial", description="Reference log-probs: the model "
                                                     "before training (computed first), or the records' own")


class Simpo(Section):
    """bunsan: SimPO (train.objective simpo, Meng et al. 2024): a reference-free margin of mean token log-probs."""
    beta: float = Field(2.0, gt=0, description="Scale of the margin of the responses' mean token log-probs: the "
                                               "loss is -log sigmoid(beta x margin - gamma)")
    gamma: float = Field(0.5, ge=0, description="The target margin subtracted inside the sigmoid")


class Orpo(Section):
    """bunsan: ORPO (train.objective orpo, Hong et al. 2024): the chosen response's NLL plus an odds-ratio term."""
    beta: float = Field(0.1, gt=0, description="Weight of the odds-ratio term: the loss is NLL(chosen) - beta x "
                                               "log sigmoid(log odds(chosen) - log odds(rejected))")


class Train(Section):
    """bunsan: the run `bunsan train` does, and process-wide settings initialize() also reads."""
    steps: Int = Field(200, ge=1, description="Optimizer steps to train (also the schedule's total when it has none)")
    seed: Int = Field(1234, ge=0, description="Random seed of the initial weights, the data order and dropout")
    output_dir: str = Field("runs/bunsan", description="Directory of the metrics, the pipeline timeline and the "
                                                       "final weights (final/)")
    init_from: Optional[str] = Field(None, description="A Hugging Face causal LM directory whose shape and weights "
                                                       "start the run; None = the model section, fresh weights")
    objective: Literal["lm", "dpo", "simpo", "orpo"] = Field("lm", description="lm: next-token loss; dpo, simpo, "
                                                             "orpo: preference pairs (the section of that name)")
    freeze: list[str] = Field(default_factory=list, description="Parameters `bunsan train` keeps frozen, by name "
                              "glob or module name, e.g. [vision_tower]")
    compile: bool = Field(False, description="torch.compile each transformer block (after activation checkpointing)")
    saving_forms: bool = Field(True, description="Run a transformers model's Llama-form RMSNorms and SiLU MLPs as "
                                                 "bunsan's (same forward; backward keeps only what it needs)")
    tf32: bool = Field(True, description="Allow TF32 matmuls and convolutions on CUDA")
    eval_interval: Int = Field(0, ge=0, description="Optimizer steps between validation losses; 0 = only at the end")
    eval_batches: Int = Field(4, ge=1, description="Validation batches per validation loss")
    # Unset: 600 s on NCCL (also its watchdog's: a first compiled step or a slow checkpoint barrier must not
    # abort the job), 120 s on gloo (distributed.collective_timeout)
    # It also bounds every set-up wait: the rendezvous under bunsan run, the ranks joining, the token caches
    timeout_s: Optional[float] = Field(None, gt=0, description="Seconds a collective or a set-up wait may take "
                                                               "before it fails; None = 600 on NCCL, 120 on gloo")
    # gloo on GPUs lets ranks share one GPU (collectives through host copies)
    backend: Backend = Field("auto", description="Process-group backend: auto (NCCL on GPUs, gloo on CPUs), nccl "
                                                 "or gloo")
    comm_warn_share: float = Field(0.3, ge=0, le=1, description="The summary advises when waiting for "
                                   "communication exceeds this share of the step time")
    # shm is 3-10x faster than native where a group's ranks share a host; exchange 3x (comm/collectives.py)
    gloo_collectives: GlooCollectives = Field("shm", description="On gloo: collectives through shared memory "
                                              "(shm), point-to-point exchanges (exchange) or gloo's own (native)")
    metrics_file: str = Field("metrics.jsonl", description="File in output_dir the metric records go to, one JSON "
                                                           "object per line")
    log_memory: bool = Field(True, description="Add every rank's measured memory to each metric record (one small "
                                               "all-gather)")
