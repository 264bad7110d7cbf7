"""`accelerate.utils` for ported scripts: the import rename gives this name to `runner.accelerate.utils`,
which this module is (one module object under both names)."""

import sys

import runner.accelerate.utils

sys.modules[__name__] = runner.accelerate.utils
