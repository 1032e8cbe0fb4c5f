"""The repository's GPU tools (not installed): the GPU suite, profiles, tuning sweeps, the model-family runs."""
