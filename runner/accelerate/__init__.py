"""Hugging Face Accelerate's public surface as an adapter over runner's core: the `Accelerator` (Accelerate's
constructor arguments, handlers and plugins mapped onto the `Engine`), `accelerate.utils`, `get_logger`,
`LocalSGD`, `find_executable_batch_size` and `ParallelismConfig`. Nothing in the core imports it
(tests/test_layers.py); a ported script reaches it through `runner` and the module names the import rename
gives it (`runner.utils`, `runner.logging`, ...)."""
