"""Memory: the theory of what a rank's model states take (theory.py) and what they do take (measure.py)."""
