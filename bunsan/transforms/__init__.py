"""Model transforms applied from outside the model: LoRA, activation checkpointing, compile."""
