"""`runner init`: the starter project's files, and the inputs it refuses (in-process; the project is
trained from an installed wheel in test_packaging.py)."""

from __future__ import annotations

import csv

import pytest

from runner.cli.init import init_project
from runner.errors import ConfigError


def test_init_names_the_package_after_the_directory(tmp_path):
    package = init_project(tmp_path / "My-Project")
    assert package == tmp_path / "My-Project" / "my_project"
    assert sorted(p.name for p in package.iterdir()) == ["__init__.py", "model.py", "task.py"]
    model_yaml = (tmp_path / "My-Project" / "conf" / "model" / "small_net.yaml").read_text()
    assert "_target_: my_project.model.SmallNet" in model_yaml and "{{" not in model_yaml
    rows = list(csv.DictReader((tmp_path / "My-Project" / "data" / "points.csv").open()))
    assert len(rows) == 400 and {row["label"] for row in rows} == {"moon_a", "moon_b"}


def test_init_takes_a_package_name_and_an_empty_existing_dir(tmp_path):
    assert init_project(tmp_path, package="lab").name == "lab"
    assert (tmp_path / "conf" / "task" / "classify.yaml").read_text().startswith("# lab/task.py")


@pytest.mark.parametrize(
    ("name", "package", "expected"),
    [
        ("class", None, "is not a Python identifier"),
        ("torch", None, "already an importable module"),
        ("fine", "2fast", "is not a Python identifier"),
    ],
)
def test_init_refuses_a_package_name_that_cannot_work(tmp_path, name, package, expected):
    with pytest.raises(ConfigError, match=expected):
        init_project(tmp_path / name, package)
    assert not (tmp_path / name).exists()  # refused before anything was written


def test_init_overwrites_nothing(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        init_project(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
