"""The built-in config groups, installed as the package runner.conf (Hydra: pkg://runner.conf)."""
