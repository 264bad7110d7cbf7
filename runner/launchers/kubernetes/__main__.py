"""A TrainJob pod's command (`python -m runner.launchers.kubernetes <args>`, what the TrainJob runner writes
gives every pod): the first pod becomes `python -m runner <args>`, which composes the job and serves it to
the others; every other pod is the agent of its node (`run_node`), which takes the job from the first."""

import os
import sys

from runner.cluster import launched_node
from runner.launchers.kubernetes.nodes import run_node

node = launched_node()
if node is None or node.node_rank == 0:
    os.execv(sys.executable, [sys.executable, "-m", "runner", *sys.argv[1:]])
sys.exit(run_node(node))
