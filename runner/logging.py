"""`accelerate.logging` for ported scripts: the import rename gives this name to `runner.accelerate.logging`,
which this module is (one module object under both names)."""

import sys

import runner.accelerate.logging

sys.modules[__name__] = runner.accelerate.logging
