"""Rank failure reports as files in a directory that every rank and its launcher share: how the local and
SLURM launchers hear what a rank raised (a launcher whose ranks share no filesystem hears it its own
way; the contract is only that `launch` raises what the first failed rank raised)."""

from __future__ import annotations

import json
import re
import time
import traceback
from pathlib import Path

import torch.distributed as dist
from hydra.errors import InstantiationException

from runner.callbacks.watchdog import read_reports
from runner.checkpoint.files import CheckpointDiscarded
from runner.errors import (
    ConfigError,
    RankFailedError,
    RendezvousError,
    TrainingInterrupted,
    TrainingStopped,
    describe_exception,
)
from runner.files import write_json

# What a rank raised, written for the launcher (the local launcher's ranks, a SLURM job's tasks): the
# exceptions raised again as they are, by class name; any other is reported with its traceback.
REPORTED_AS_IS = {  # the most specific first: a rank's error is reported as the first it is an instance of
    error.__name__: error for error in (ConfigError, TrainingInterrupted, RendezvousError, TrainingStopped)
}
LOST_PEER_GRACE_S = 2.0
# What a rank may stop with that a restart of the rank group would only repeat: a setting refused, a stop
# signal (the run resumes when its command runs again), a divergence (resumed from the checkpoint before
# it, the run diverges again). A rendezvous that failed may succeed the next time.
REPEATED_BY_A_RESTART = (ConfigError.__name__, TrainingInterrupted.__name__, TrainingStopped.__name__)


def lost_a_peer(err: BaseException) -> bool:
    """Whether `err` is a consequence of another rank's failure, not a cause: a collective failing because
    that rank went away, or the checkpoint being written discarded by it."""
    return isinstance(err, (dist.DistError, CheckpointDiscarded)) or bool(
        re.search(r"(closed|reset) by peer|remote worker|communicator was aborted", str(err))
    )


def report_failure(error_dir: Path, rank: int, err: BaseException) -> None:
    """Write what rank `rank` raised into `<error_dir>/rank<rank>.json` (after a moment when its collective
    merely lost a peer, so that the peer's own failure is seen first)."""
    if isinstance(err, InstantiationException) and isinstance(err.__cause__, tuple(REPORTED_AS_IS.values())):
        err = err.__cause__  # a refusal raised while Hydra built an object (the data source): reported as it is
    lost_peer = lost_a_peer(err)
    if lost_peer:
        time.sleep(LOST_PEER_GRACE_S)
    kind = next((name for name, error in REPORTED_AS_IS.items() if isinstance(err, error)), None)
    report = {
        "time": time.time(),
        "lost_peer": lost_peer,
        "kind": kind,
        "message": str(err),
        "signum": getattr(err, "signum", None),  # TrainingInterrupted's: the signal that stopped the rank
        "traceback": traceback.format_exc(),
        "summary": describe_exception(err),
    }
    error_dir.mkdir(parents=True, exist_ok=True)
    write_json(error_dir / f"rank{rank}.json", report, indent=None)


def repeated_failure(error_dir: Path) -> str | None:
    """The kind of a reported failure in `error_dir` that a restart would repeat
    (`REPEATED_BY_A_RESTART`), else None."""
    for path in error_dir.glob("rank*.json"):
        try:
            kind = json.loads(path.read_text())["kind"]
        except (OSError, ValueError, KeyError):
            continue
        if kind in REPEATED_BY_A_RESTART:
            return kind
    return None


def reported_failure(error_dir: Path, causes_only: bool = False) -> Exception | None:
    """What to raise for the ranks' reports in `error_dir` (None: none reported): the first rank that raised
    (ranks that merely lost a peer last), its exception again when it is one of REPORTED_AS_IS, else a
    RankFailedError with its traceback. `causes_only`: None too when every report is of a lost peer (the
    rank that failed first wrote none: it was killed)."""
    reports = {
        int(path.stem.removeprefix("rank")): json.loads(path.read_text())
        for path in error_dir.glob("rank*.json")
    }
    if not reports or (causes_only and all(report["lost_peer"] for report in reports.values())):
        return None
    rank = min(reports, key=lambda r: (reports[r]["lost_peer"], reports[r]["time"]))
    if (kind := reports[rank]["kind"]) is not None:
        error = REPORTED_AS_IS[kind](reports[rank]["message"])
        if kind == TrainingInterrupted.__name__:
            error.signum = reports[rank].get("signum")
        return error
    others = sorted(set(reports) - {rank})
    also = f" (rank {', '.join(map(str, others))} failed too)" if others else ""
    report = reports[rank]
    return RankFailedError(
        f"rank {rank} raised; the other ranks were stopped{also}.\n{report.get('summary') or report['traceback']}",
        details=report["traceback"],
    )


def hang_failure(run_dir: Path, since: float) -> RankFailedError | None:
    """What to raise for the watchdogs' reports in `run_dir` written since `since` (None: no rank hung):
    the message of the rank whose main thread was in its own code (not waiting inside torch), then where
    each other rank was."""
    reports = read_reports(run_dir, since)
    if not reports:
        return None
    rank = likeliest_hang(reports)
    return RankFailedError(
        f"{reports[rank]['message']}{_also_hung(reports, rank)} The other ranks were stopped."
    )


def likeliest_hang(reports: dict[int, dict]) -> int:
    """Of the ranks whose watchdogs ended them (`read_reports`), the likeliest cause: one whose main
    thread was in its own code, not waiting inside torch (for the others); the lowest rank of those."""
    return min(reports, key=lambda r: (reports[r]["in_torch"], r))


def _also_hung(reports: dict[int, dict], rank: int) -> str:
    """The other ranks whose watchdogs ended them, each with where it was; where all waited inside torch
    at different places of the code, they were in different collectives (one rank skipped one or made
    one of its own)."""
    others = [
        f" Rank {r} made no progress either ({reports[r]['doing']}, at {reports[r].get('where', 'an unknown place')})."
        for r in sorted(reports)
        if r != rank
    ]
    places = {report.get("where") for report in reports.values()}
    mismatched = len(places) > 1 and all(report["in_torch"] for report in reports.values())
    hint = (
        " The ranks wait inside torch at different places of the code: they are in different collectives (a rank "
        "skipped a collective, or called one of its own that the others do not)."
    )
    return "".join(others) + (hint if mismatched else "")
