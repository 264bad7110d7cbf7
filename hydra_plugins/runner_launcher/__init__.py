"""runner's Hydra launcher: a sweep's jobs where their `launcher` says (SLURM arrays for `launcher=slurm`)."""
