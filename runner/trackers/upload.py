"""Send a run's tracking records to MLflow or W&B: those a run could not deliver (the server was down,
the process was killed before W&B wrote them),

    python -m runner.trackers.upload <run dir> [--uri http://host:port]

and, with `--serve`, those of the runs a process is writing: the sender `MLflowTracker` starts, told on
its stdin which journals to follow.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import queue
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from runner.run_dir import TRACKING
from runner.trackers.journal import Journal
from runner.trackers.mlflow import SENDER_LOG, UPLOAD, Delivery, mlflow_client, remote_store
from runner.trackers.wandb import upload as wandb_upload

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often a sender looks for new records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runner.trackers.upload", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "run_dir", type=Path, nargs="?", help="the run's output directory (it holds tracking/)"
    )
    parser.add_argument("--uri", help="the tracking URI to send to; default: the one the run used")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the tracker's sender
    parser.add_argument("--console-fd", type=int, help=argparse.SUPPRESS)  # where a sender warns
    args = parser.parse_args(argv)
    if args.serve:
        return serve(sys.stdin.buffer, os.fdopen(args.console_fd, "w") if args.console_fd else None)
    if args.run_dir is None:
        parser.error("the run's output directory is required")
    if (status := wandb_upload(args.run_dir)) is not None:
        return status
    directory = args.run_dir / TRACKING
    if not (directory / "events.jsonl").exists():
        print(f"{args.run_dir} has no tracking records ({TRACKING}/events.jsonl).", file=sys.stderr)
        return 2
    journal = Journal(directory)
    lock = journal.lock_for_sending()
    if lock is None:
        print(
            f"A sender is still delivering the records of {args.run_dir} (see {SENDER_LOG}); run this again "
            "when it has finished.",
            file=sys.stderr,
        )
        return 1
    with lock:
        journal.refresh()
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


@dataclass
class Followed:
    """A journal a sender delivers: `lock` once this sender may send it (an earlier sender of the same
    run dir, a resumed run's, may still be at it)."""

    journal: Journal
    delivery: Delivery
    lock: IO | None = None
    failed: bool = False
    contacted: bool = False  # something was sent

    def may_warn(self) -> bool:
        """Whether this run's one console warning (its server cannot be reached) may still come: its
        store is remote and nothing was sent to it yet, nor did sending fail. A local store (SQLite, files)
        is only ever this machine's disk: its problems go to the sender's log."""
        return remote_store(self.delivery.uri) and not self.failed and not self.contacted

    def step(self, writer_gone: bool) -> bool:
        """Send what is new; True once done with the journal: its run ended (or `writer_gone`) and all was
        sent, or sending failed and the one more try at the end did too."""
        if self.lock is None and (lock := self.journal.lock_for_sending()) is None:
            return False
        self.lock = lock if self.lock is None else self.lock
        journal = self.journal.refresh()
        ended = writer_gone or (bool(journal.events) and journal.events[-1]["op"] == "end")
        if journal.pending and (ended or not self.failed):
            if self.delivery.send_pending():
                self.contacted = True
            else:
                self.failed = True
                journal.mark_failed(self.delivery.error)
        if not ended:
            return False
        if journal.events and journal.events[-1]["op"] != "end" and not journal.pending:
            self.delivery.close_run("KILLED")  # its process died without ending it (kill -9, out of memory)
        journal.mark_closed()
        self.lock.close()
        return True


def serve(requests: IO[bytes], console: IO[str] | None) -> int:
    """Follow the journals named on `requests` (one JSON line each: `journal`, `uri`), delivering each
    until its run ends; return when `requests` is closed (the writing process exited or died) and every
    journal is done. It runs at the normal priority: the run's end waits for it, and inside a job's CPU
    cgroup a sender at idle priority got a tenth of a core while the other processes kept the cores busy."""
    sender = Sender(_log_to(console), console)
    named = Requests()
    threading.Thread(target=_read_requests, args=(requests, named), daemon=True).start()
    try:  # needed for any delivery: imported now, beside the start of the command that started this sender
        # (in this thread: MLflow's protobuf modules cannot be imported from two)
        importlib.import_module("mlflow")
    except Exception as err:  # the first delivery reports it
        log.info("MLflow could not be imported: %s", err)
    while not sender.writer_gone or sender.followed:
        while not named.empty():
            sender.take(named.get())
        if sender.writer_gone and not any(item.may_warn() for item in sender.followed):
            # The console may be a pipe (`| tee`, a CI log) that its reader waits on until every holder has
            # closed it: let go once the writer is gone and no run can still warn there (before sending:
            # a first delivery to a local store alone takes a second or more, MLflow's import and its tables).
            sender.let_go_of_console()
        sender.step()
        if not sender.writer_gone or sender.followed:
            named.wake.wait(POLL_S)  # at once when the writer exits
            named.wake.clear()
    sender.let_go_of_console()
    return 1 if sender.failed else 0


@dataclass
class Sender:
    """What `serve` holds: the console it may warn on, the journals it follows, whether the writing
    process is gone and whether a delivery failed."""

    console_handler: logging.Handler | None
    console: IO[str] | None
    followed: list[Followed] = field(default_factory=list)
    writer_gone: bool = False
    failed: bool = False

    def take(self, request: dict | None) -> None:
        """Act on one request: None (the writer is gone), a log file to write to from now on, a store to
        open before the first journal (`warm`), or a journal to follow."""
        if request is None:
            self.writer_gone = True
        elif "log" in request:  # started early: its output goes to this run's log from now on
            output = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(output, 1)
            os.dup2(output, 2)
            os.close(output)
        elif "warm" in request:  # MLflow imported and the store opened before the first journal
            warm(request["warm"])
        else:
            journal = Journal(Path(request["journal"]))
            self.followed.append(Followed(journal, Delivery(journal, request["uri"])))

    def step(self) -> None:
        """Send what is new of each journal; drop those done with."""
        for item in list(self.followed):
            try:
                done = item.step(self.writer_gone)
            except Exception as err:  # a bug or a broken journal: this run's records wait for an upload
                traceback.print_exc()  # to the sender's log
                log.error(
                    "MLflow: sending %s stopped (%s: %s); its records are kept there (upload them with `%s %s`).",
                    item.journal.directory,
                    type(err).__name__,
                    err,
                    UPLOAD,
                    item.journal.directory.parent,
                )
                done = item.failed = True
            if done:
                self.failed |= item.failed
                self.followed.remove(item)

    def let_go_of_console(self) -> None:
        if self.console_handler is not None:
            logging.getLogger("runner").removeHandler(self.console_handler)
            self.console_handler.close()
            self.console.close()  # type: ignore[union-attr]
            self.console_handler = None


def warm(uri: str) -> None:
    """Import MLflow and open the store at `uri` (a client made later for it reuses the open store);
    a failure is the first delivery's to report."""
    try:
        mlflow_client(uri).search_experiments(max_results=1)
    except Exception as err:
        log.info("MLflow at %s: not ready yet (%s)", uri, err)


class Requests(queue.Queue):
    """The journals named on the sender's stdin, in order; None once the writing process is gone, which
    also sets `wake`."""

    def __init__(self) -> None:
        super().__init__()
        self.wake = threading.Event()


def _read_requests(requests: IO[bytes], named: Requests) -> None:
    journals = 0
    for line in requests:
        request = json.loads(line)
        journals += "journal" in request
        named.put(request)
    if not journals:  # the command tracked nothing (refused, a plan): MLflow's import is of no use
        os._exit(0)
    named.put(None)  # end of file: the writing process is gone
    named.wake.set()


def _log_to(console: IO[str] | None) -> logging.Handler | None:
    """Everything (MLflow's own lines too) to this process's stderr, the sender's log file; the runner's
    warnings also to the console of the process that started it, while that process runs (the handler)."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] %(message)s")
    if console is None:
        return None
    handler = logging.StreamHandler(console)
    handler.setLevel(logging.WARNING)
    logging.getLogger("runner").addHandler(handler)
    return handler


if __name__ == "__main__":
    sys.exit(main())
