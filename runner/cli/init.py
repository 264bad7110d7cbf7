"""`runner init <dir>`: write a starter project (a config dir with one experiment, a model, a task, a data
file) that runs as written: `runner --config-dir conf experiment=example` in that dir."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import keyword
import math
import random
import re
import shutil
from pathlib import Path

from runner.errors import ConfigError

STARTER = Path(__file__).resolve().parent / "starter"  # the project's files; `package/` takes its name
TEXT_SUFFIXES = {".md", ".yaml"}  # where {{name}} and {{package}} are filled in


def init_project(directory: Path, package: str | None = None) -> Path:
    """Write the starter project into `directory` (new or empty); return the package's path."""
    directory = directory.expanduser().resolve()
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ConfigError(
            f"runner init {directory}: {'not a directory' if not directory.is_dir() else 'the directory is not empty'}"
            "; init writes a whole project and overwrites nothing. Give a new or empty directory."
        )
    package = package or re.sub(r"\W", "_", directory.name).lower()
    problem = _package_problem(package)
    if problem:
        raise ConfigError(
            f"runner init: the package name {package!r} (from the directory's name) {problem}. Choose one with "
            "--package NAME (a Python identifier that no installed module uses)."
        )
    shutil.copytree(STARTER, directory, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    (directory / "package").rename(directory / package)
    for path in directory.rglob("*"):
        if path.suffix in TEXT_SUFFIXES:
            text = path.read_text().replace("{{name}}", directory.name).replace("{{package}}", package)
            path.write_text(text)
    write_points(directory / "data" / "points.csv")
    return directory / package


def _package_problem(name: str) -> str | None:
    if not name.isidentifier() or keyword.iskeyword(name):
        return "is not a Python identifier"
    if importlib.util.find_spec(name) is not None:
        return "is already an importable module, which the project's package would shadow or be shadowed by"
    return None


def write_points(path: Path, rows: int = 400, seed: int = 0) -> None:
    """Two interleaved half-moons with noise: columns x, y and the class label (moon_a, moon_b)."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["x", "y", "label"])
        for i in range(rows):
            angle = rng.uniform(0, math.pi)
            upper = i % 2 == 0
            x = math.cos(angle) if upper else 1 - math.cos(angle)
            y = math.sin(angle) if upper else 0.5 - math.sin(angle)
            writer.writerow(
                [
                    f"{x + rng.gauss(0, 0.1):.4f}",
                    f"{y + rng.gauss(0, 0.1):.4f}",
                    "moon_a" if upper else "moon_b",
                ]
            )


def main(argv: list[str]) -> None:
    """`runner init DIR [--package NAME]`."""
    parser = argparse.ArgumentParser(
        prog="runner init",
        description="Write a starter project: a config dir with one experiment, a model, a task and a data file.",
    )
    parser.add_argument("directory", type=Path, help="a new or empty directory")
    parser.add_argument("--package", help="the Python package of your code (default: the directory's name)")
    args = parser.parse_args(argv)
    try:
        package = init_project(args.directory, args.package)
    except OSError as err:  # a read-only file system, a file where a directory goes, no permission
        raise ConfigError(
            f"runner init {args.directory}: cannot write {err.filename or args.directory} ({err.strerror}). Give a "
            "new or empty directory where you can write."
        ) from None
    print(
        f"Wrote a runner project in {args.directory} (your code: {package.name}/). Run it:\n"
        f"  cd {args.directory} && runner --config-dir conf experiment=example"
    )
