"""Checkpointing, in one place.

- `files`, `weights`: checkpoint directories on disk (atomic commit, `latest`, keep-last-k, metadata and
  digests, the background writer); weight files and loading them into a model;
- `formats`: how models and optimizers are stored (whole-model safetensors, DCP shards, DeepSpeed's);
- `accelerate_layout`: Accelerate's file names, both ways (a full checkpoint loads in Accelerate's
  `load_state`; a directory Accelerate's `save_state` wrote loads here);
- `resume`: the resume policy (which checkpoint, whether it fits this run, the learning rate after a
  resume, `last_finite`);
- `checkpointer`: the `Checkpointer`, which owns the registry of stateful objects and saves and loads it.

The package imports nothing itself: `files` and `weights` sit below the hardware strategies (the models,
big model inference and the launchers read them), the rest above them.
"""
