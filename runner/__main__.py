"""`python -m runner` and the `runner` command. It composes the run's config before it imports torch
(`runner.compose.compose_command`): a config that does not compose is refused without waiting for torch.
A SIGTERM while the command still imports and composes ends it with one line (exit 143), not silently;
from the job on, `runner.cli.main` says how far the run got. A process that multiprocessing starts from
the command (a rank, a `prepare-data` worker) imports the command's main module again (as
`__mp_main__`): there, this module neither catches SIGTERM nor starts anything."""

import atexit
import gc
import signal
import sys

# The imports below (torch, Hydra, runner: a few hundred thousand objects) run without the cyclic collector,
# whose full collections would walk that growing heap again and again (0.1-0.2 s of every start here).
COLLECTING = gc.isenabled()
gc.disable()


def _stopped_while_starting(signum: int, frame: object) -> None:
    sys.stderr.write(
        f"Training interrupted: stopped by {signal.Signals(signum).name} while starting, before it ran.\n"
    )
    sys.exit(128 + signum)


# `python -m runner` or the `runner` command, not a process multiprocessing started from it (the `runner`
# script's worker imports this module under its own name, from the script it runs as `__mp_main__`)
COMMAND = "__mp_main__" not in (__name__, getattr(sys.modules.get("__main__"), "__name__", None))
if COMMAND:
    signal.signal(signal.SIGTERM, _stopped_while_starting)  # before the imports, which are most of the start

from runner.compose import compose_command, end_command  # noqa: E402  (no torch)
from runner.errors import ConfigError  # noqa: E402
from runner.trackers.mlflow import Sender  # noqa: E402  (no torch: it imports MLflow beside torch's import)

COMPOSED = None  # the command's run, composed before torch loads: a refusal does not wait for it
if COMMAND:
    try:
        COMPOSED = compose_command(sys.argv[1:])
    except ConfigError as err:
        end_command(err)
    Sender.start_early(sys.argv[1:])

from runner.cli import leave_the_heap, run  # noqa: E402

gc.freeze()  # what the imports made lives as long as the process: no collection walks it again
if COLLECTING:
    gc.enable()


def main() -> None:
    """The command."""
    atexit.register(leave_the_heap)  # registered first: runs last
    run(COMPOSED)


if __name__ == "__main__":  # spawned ranks import this module again: they must not re-run the CLI
    main()
