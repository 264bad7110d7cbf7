"""What a run records of itself beside its checkpoints: the metric history (`history`), the goodput
ledger (`goodput`) and the figures drawn from them (`plots`)."""
