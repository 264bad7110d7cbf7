"""`accelerate.accelerator` for ported scripts: the import rename gives this name to `runner.accelerate.accelerator`,
which this module is (one module object under both names)."""

import sys

import runner.accelerate.accelerator

sys.modules[__name__] = runner.accelerate.accelerator
