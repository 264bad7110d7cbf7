"""Checkpointing, in one place.

- `files`: checkpoint directories on disk (atomic commit, `latest`, keep-last-k, metadata and digests,
  the background writer);
- `formats`: how models and optimizers are stored (whole-model safetensors, DCP shards);
- `resume`: the resume policy (which checkpoint, whether it fits this run, the learning rate after a
  resume, `last_finite`);
- `checkpointer`: the `Checkpointer`, which owns the registry of stateful objects and saves and loads it.

The package imports nothing itself: `files` and `formats` sit below the hardware strategies (which write
their state through them), `checkpointer` above them.
"""
