"""Send the tracking records a run could not deliver (the server was down) to MLflow:

python -m runner.trackers.upload <run dir> [--uri http://host:port]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runner.trackers.journal import Journal
from runner.trackers.mlflow import JOURNAL_DIR, Delivery


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runner.trackers.upload", description=__doc__.split("\n")[0]
    )
    parser.add_argument("run_dir", type=Path, help="the run's output directory (it holds tracking/)")
    parser.add_argument("--uri", help="the tracking URI to send to; default: the one the run used")
    args = parser.parse_args(argv)
    directory = args.run_dir / JOURNAL_DIR
    if not (directory / "events.jsonl").exists():
        print(f"{args.run_dir} has no tracking records ({JOURNAL_DIR}/events.jsonl).", file=sys.stderr)
        return 2
    journal = Journal(directory)
    if not journal.pending:
        print(
            f"nothing to upload: all {len(journal.events)} records of run {journal.state['run_id']} were sent."
        )
        return 0
    pending = journal.pending
    uri = args.uri or journal.events[0]["uri"]
    if not Delivery(journal, uri).send_pending():
        return 1
    print(f"uploaded {pending} record(s) to {uri}, run {journal.state['run_id']}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
