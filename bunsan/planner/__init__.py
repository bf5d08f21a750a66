"""The planner: which layouts fit a model on given GPUs, ranked by an estimated step time."""
