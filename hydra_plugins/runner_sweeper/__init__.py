"""runner's Hydra plugins: the resumable grid sweeper."""
