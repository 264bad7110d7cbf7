"""A queued SLURM job followed to its end: its log streamed, why it waits (`squeue`), and the nodes whose
failure ended it (`sacct`); where its tasks report what they raised."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from runner.errors import RankFailedError

log = logging.getLogger(__name__)


NODE_CHECK_INTERVAL_S = 5.0  # how often a job not running is checked for a lost node
RANK_ERRORS = "rank_errors"  # in submitit's folder (a sweep job's: its dir's slurm/): what each task raised


def lost_nodes(job_id: str) -> list[str]:
    """The nodes whose failure ended SLURM job `job_id` (its run that ended NODE_FAIL), each with its state
    and reason now: `rnode2 (down*: Not responding)`."""
    try:
        history = subprocess.run(
            ["sacct", "--duplicates", "--allocations", "--noheader", "--parsable2", "--jobs", job_id,
             "--format=State,NodeList"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    nodes = [nodelist for state, _, nodelist in (line.partition("|") for line in history.splitlines())
             if state == "NODE_FAIL"]  # fmt: skip
    if not nodes:
        return []
    try:
        states = subprocess.run(
            ["sinfo", "--noheader", "--Node", "--nodes", ",".join(nodes), "--format=%N|%T|%E"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return sorted(set(nodes))
    lost = {}
    for line in states.splitlines():
        name, state, reason = line.split("|", 2)
        if not state.startswith(("idle", "mixed", "allocated", "completing")) or state.endswith("*"):
            lost[name] = f"{name} ({state}: {reason})"
    return list(lost.values()) or sorted(set(nodes))


def node_failure(job_id: str, output_dir: Path, log_file: Path) -> RankFailedError | None:
    """If SLURM job `job_id` lost a node, the error that names it, once the job is cancelled: SLURM
    requeues a job that lost a node, and it would start again, unwatched, once it had nodes."""
    lost = lost_nodes(job_id)
    if not lost:
        return None
    subprocess.run(["scancel", job_id], capture_output=True, check=False)
    return RankFailedError(
        f"SLURM job {job_id} lost node(s) {'; '.join(lost)}, and was cancelled (SLURM had requeued it). Run the "
        f"same command to resume from its latest checkpoint in {output_dir} on healthy nodes. Rank 0's log: "
        f"{log_file}."
    )


def pending_reason(job_id: str) -> str:
    """Why SLURM has not started job `job_id` (`Resources`, `Nodes required for job are DOWN, ...`), as
    squeue says; empty once it runs or is gone."""
    try:
        out = subprocess.run(
            ["squeue", "--noheader", "--states=PENDING", "--format=%r", "--jobs", job_id],
            capture_output=True, text=True, timeout=30, check=False,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.strip().replace("_", " ")


def follow(submitted: Any, log_file: Path, poll_interval_s: float, output_dir: Path) -> None:
    """Copy what rank 0 writes to its log onto this process's stderr until the job ends (a requeued job
    starts its log again: read it from the start). A job that lost a node is cancelled and raised as
    `node_failure`'s error (it would wait to be started again)."""
    offset = 0
    checked = time.monotonic()
    reason = ""
    while True:
        done = submitted.done()
        if not done and time.monotonic() - checked > NODE_CHECK_INTERVAL_S and submitted.state != "RUNNING":
            checked = time.monotonic()
            if failure := node_failure(submitted.job_id, output_dir, log_file):
                raise failure
            if (now := pending_reason(submitted.job_id)) and now != reason:
                log.info("SLURM job %s is pending: %s", submitted.job_id, now)
            reason = now
        try:
            size = log_file.stat().st_size
        except FileNotFoundError:
            size = 0
        if size < offset:
            offset = 0
        if size > offset:
            with open(log_file, "rb") as f:
                f.seek(offset)
                chunk = f.read(size - offset)
            offset = size
            sys.stderr.write(chunk.decode(errors="replace"))
            sys.stderr.flush()
        if done:
            return
        time.sleep(poll_interval_s)
