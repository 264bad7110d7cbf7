"""`accelerate.parallelism_config` for ported scripts: the import rename gives this name to `runner.accelerate.parallelism_config`,
which this module is (one module object under both names)."""

import sys

import runner.accelerate.parallelism_config

sys.modules[__name__] = runner.accelerate.parallelism_config
