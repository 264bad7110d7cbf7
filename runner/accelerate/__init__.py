"""Hugging Face Accelerate's public surface as an adapter over runner's core: the `Accelerator` (its
constructor's arguments, kwargs handlers and plugins translated into the Engine's, the strategy's and the
precision's own options), `PartialState`, `accelerate.utils`, `get_logger`, `LocalSGD`,
`find_executable_batch_size`, `ParallelismConfig` and what `accelerate launch` set. Nothing in the core
imports it (tests/test_layers.py); a ported script reaches it through `runner` and the module names the
import rename gives it (`runner.utils`, `runner.logging`, ...)."""
