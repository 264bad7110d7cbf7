"""What runs in the workers of `launcher=ray`'s worker group: the rank's body, which reports to the
launching process through files in the run dir (storage every node reaches): where each rank runs, what
it raised, rank 0's metrics. (Their place comes from runner's Ray Train backend, `backend.py`.)"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path
from typing import Any

from runner.cluster.ray import ATTEMPT
from runner.files import write_text
from runner.launchers.base import Job, run_rank
from runner.launchers.reports import repeated_failure, report_failure
from runner.train import request_stop

ERRORS = "errors"  # what each rank raised (`report_failure`)
WORKERS = "workers"  # rank<r>.json: where each rank of the current attempt runs (node, host, pid)
RESULT = "result.json"  # rank 0's metrics
STOP = "stop"  # written by the launching process on a stop signal: the signal's number
STOP_POLL_S = 0.5


def rank_entry(config: dict[str, Any]) -> None:
    """One rank (Ray Train's `train_loop_per_worker`, in a thread of the worker). It says where it runs,
    then runs the job; what it raises is reported and raised (Ray restarts the group, up to its failures);
    a start of the group after a failure that a restart would repeat (a refusal, a stop, a divergence)
    ends at once, so that the launcher reports that failure."""
    job: Job = config["job"]
    reports = Path(config["reports"])
    rank = int(os.environ["RANK"])
    if Path(config["cwd"]).is_dir():  # the command's dir, as the ranks of every launcher: relative paths hold
        os.chdir(config["cwd"])
    if repeated_failure(reports / ERRORS):
        return
    import ray

    where = {
        "rank": rank,
        "node_id": ray.get_runtime_context().get_node_id(),
        "host": socket.gethostname(),
        "ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
        "attempt": int(os.environ[ATTEMPT]),
    }
    (reports / WORKERS).mkdir(parents=True, exist_ok=True)
    write_text(reports / WORKERS / f"rank{rank}.json", json.dumps(where))
    stopped = threading.Event()
    threading.Thread(target=_stop_when_asked, args=(reports / STOP, stopped), daemon=True).start()
    try:
        metrics = run_rank(job, launcher_reports=True)
    except BaseException as err:
        report_failure(reports / ERRORS, rank, err)
        raise
    finally:
        stopped.set()
    if rank == 0:
        write_text(reports / RESULT, json.dumps(metrics))


def _stop_when_asked(request: Path, done: threading.Event) -> None:
    """Pass the launching process's stop signal (`STOP`) on to the loop, as the signal would stop it."""
    while not done.wait(STOP_POLL_S):
        if request.exists():
            request_stop(int(request.read_text() or 15))
            return
