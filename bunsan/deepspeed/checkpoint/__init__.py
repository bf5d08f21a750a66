"""`deepspeed.checkpoint`: utils.clone_tensors_for_torch_save (what accelerate imports to save a state dict)."""
