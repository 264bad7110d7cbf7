"""`accelerate.local_sgd` for ported scripts: the import rename gives this name to `runner.accelerate.local_sgd`,
which this module is (one module object under both names)."""

import sys

import runner.accelerate.local_sgd

sys.modules[__name__] = runner.accelerate.local_sgd
