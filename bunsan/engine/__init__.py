"""The engine: one training step for every layout (engine.py), precision and the LM loss."""
