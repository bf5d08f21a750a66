"""The engine: one training step for every layout (engine.py), what a batch is and how it becomes the loss
(batch.py), and fp16 loss scaling (precision.py)."""
