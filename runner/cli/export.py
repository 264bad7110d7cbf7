"""`runner export RUN_DIR --to hf OUT`: the run's model as a transformers model dir (`runner.export`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from runner.export import export_hf

FORMATS = ("hf",)


def main(arguments: list[str]) -> None:
    """Write the model of a run dir as the format `--to` names, and say what was written and checked."""
    parser = argparse.ArgumentParser(prog="runner export", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's dir, as `runner runs` lists it")
    parser.add_argument("--to", choices=FORMATS, required=True, help="hf: a transformers model dir")
    parser.add_argument("out", metavar="OUT", help="the directory to write (new)")
    parser.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="the checkpoint to export (e.g. RUN_DIR/checkpoints/checkpoint_3; default: the run's final "
        "model/, else its latest checkpoint)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="the tokenizer dir to write beside it (default: the run's data.tokenizer)",
    )
    args = parser.parse_args(arguments)
    out = Path(args.out)
    exported = export_hf(
        Path(args.run_dir),
        out,
        Path(args.checkpoint) if args.checkpoint else None,
        Path(args.tokenizer) if args.tokenizer else None,
    )
    print(exported.describe(out))
