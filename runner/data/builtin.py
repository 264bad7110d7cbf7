"""Data sets shipped inside the package (see `runner/data/assets/`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runner.data.table import TableFile
from runner.data.text import TextFile

ASSETS = Path(__file__).parent / "assets"


def digits(**kwargs: Any) -> TableFile:
    """UCI optical handwritten digits (1797 8x8 images, 10 classes; CC BY 4.0, via scikit-learn)."""
    return TableFile(path=str(ASSETS / "digits.csv.gz"), target="label", task="classification", **kwargs)


def sonnets(**kwargs: Any) -> TextFile:
    """Fourteen of Shakespeare's sonnets (public domain), about 8.6 kB of text."""
    return TextFile(path=str(ASSETS / "sonnets.txt"), **kwargs)
