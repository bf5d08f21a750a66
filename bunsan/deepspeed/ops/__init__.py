"""`deepspeed.ops`: DeepSpeed's optimizer classes, as the torch optimizers that compute the same update."""
