"""Your models and tasks: configs name them by `_target_` (conf/model, conf/task)."""
