"""The commands in the README and the docs compose: every `python -m runner ...` line of their shell blocks
names groups, options and keys that exist, with values of the right type (Hydra's compose API, in this
process). `mkdocs build --strict` in the test command checks the links."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_env
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from runner.config import CONF_DIR
from runner.group_schemas import register_configs

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*```(\w*)")


def shell_lines(page: Path) -> list[str]:
    """The lines of `page`'s shell blocks, continuation lines (`\\`) joined."""
    lines, block, language = [], "", None  # None: outside a fenced block
    for line in page.read_text().splitlines():
        if fence := FENCE.match(line):
            language = fence.group(1) if language is None else None
            continue
        if language not in ("bash", "sh"):
            continue
        block += line.rstrip().removesuffix("\\") + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            lines.append(block.strip())
            block = ""
    return lines


def runner_commands() -> list[tuple[str, list[str]]]:
    """(where, overrides) of every `python -m runner` / `runner` command that uses the built-in configs."""
    found = []
    for page in PAGES:
        for line in shell_lines(page):
            for part in re.split(r"&&|;", line):
                words = shlex.split(part, comments=True)
                while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # environment variables
                    words.pop(0)
                if words[:3] == ["python", "-m", "runner"]:
                    args = words[3:]
                elif words[:1] == ["runner"] and words[1:2] not in (["init"], ["runs"], ["export"], ["join"]):  # compose nothing
                    args = words[1:]
                else:
                    continue
                if "--config-dir" in args or "--help" in args:  # a user's project; Hydra's help
                    continue
                if args[:1] == ["prepare-data"]:  # composes the overrides that follow as a run does
                    args = args[1:]
                if args[:1] == ["estimate-memory"]:  # the same, beside its own option
                    args = [a for a in args[1:] if not a.startswith("--num-processes") and not a.isdigit()]
                found.append((f"{page.name}: {part.strip()[:120]}", args))
    return found


def first_of_each_sweep(args: list[str]) -> list[str]:
    """The overrides of one job of the command: flags and Hydra's own settings dropped, each sweep's first
    value taken."""
    # placeholders the reader fills in (`checkpoint=<dir>`) stand for a path
    args = [
        re.sub(r"<[\w ]+>", "placeholder", a) for a in args if a not in ("-m", "--multirun", "--cfg", "job")
    ]
    overrides = []
    for override in OverridesParser.create().parse_overrides(args):
        key = override.get_key_element()
        if key.startswith(("hydra", "+hydra")):
            continue
        if override.is_sweep_override():
            if override.is_interval_sweep():  # an Optuna search space: its lower bound
                value = str(override.value().start)  # type: ignore[union-attr]
            else:
                value = next(override.sweep_string_iterator())
            overrides.append(f"{key}={value}")
        else:
            overrides.append(override.input_line)
    return overrides


COMMANDS = runner_commands()


@pytest.fixture(scope="module", autouse=True)
def hydra_context():
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


def test_the_docs_show_commands():
    pages = {where.split(":")[0] for where, _ in COMMANDS}
    assert len(COMMANDS) > 80 and {"README.md", "guide.md", "hardware.md", "checkpoints.md"} <= pages


@pytest.mark.parametrize(("where", "args"), COMMANDS, ids=[where for where, _ in COMMANDS])
def test_a_docs_command_composes(where, args):
    compose("config", overrides=first_of_each_sweep(args))


def test_a_command_with_a_misspelt_key_does_not_compose():
    """The check above can fail: a key that is not there is refused."""
    with pytest.raises(Exception, match="max_step"):
        compose("config", overrides=first_of_each_sweep(["trainer.max_step=5"]))


def quoted_sessions() -> list[tuple[str, str, list[str]]]:
    """(page, command, the output it quotes) of every `$ command` line in the docs' `text` blocks."""
    found: list[tuple[str, str, list[str]]] = []
    for page in PAGES:
        language = None
        for line in page.read_text().splitlines():
            if fence := FENCE.match(line):
                language = fence.group(1) if language is None else None
                continue
            if language != "text":
                continue
            if line.startswith("$ "):
                found.append((page.name, line[2:], []))
            elif found and found[-1][0] == page.name and line.strip():
                found[-1][2].append(line.strip())
    return found


SESSIONS = quoted_sessions()


@pytest.mark.slow
@pytest.mark.parametrize(("page", "command", "quoted"), SESSIONS, ids=[c for _, c, _ in SESSIONS])
def test_a_quoted_message_is_what_the_command_prints(tmp_path, page, command, quoted):
    """What the docs show a command printing is what it prints today (run here, on the CPU)."""
    proc = subprocess.run(
        [sys.executable, *shlex.split(command, comments=True)[1:]],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    printed = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert printed == quoted, f"{page}: `{command}` prints\n" + "\n".join(printed)


def test_the_docs_quote_messages():
    assert len(SESSIONS) >= 4 and all(quoted for _, _, quoted in SESSIONS)


# The config dirs under conf/ that are not groups a user chooses an option of (Hydra's own; JSON files).
NOT_GROUPS = {"hydra", "deepspeed", "__pycache__"}  # __pycache__: conf/__init__.py's bytecode, where a run wrote it


def groups_table(page: Path) -> dict[str, set[str]]:
    """The "Config groups" table of `page`: group -> the options its row names."""
    section = page.read_text().split("## Config groups", 1)[1].split("\n#", 1)[0]
    rows = [line.split("|") for line in section.splitlines() if line.startswith("| `")]
    return {row[1].strip().strip("`"): set(re.findall(r"`([\w]+)`", row[2])) for row in rows}


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "docs" / "guide.md"], ids=["README", "guide"])
def test_the_config_groups_table_names_every_group_and_every_option(page):
    table = groups_table(page)
    for group in sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in NOT_GROUPS):
        options = {path.stem for path in group.glob("*.yaml")}
        assert group.name in table, f"{page.name}: the config groups table has no row for `{group.name}`"
        assert options <= table[group.name], f"{page.name}: `{group.name}` lacks {sorted(options - table[group.name])}"


def test_every_docs_page_is_in_the_index_and_the_site_nav():
    index = (ROOT / "docs" / "index.md").read_text()
    nav = (ROOT / "mkdocs.yml").read_text().split("nav:", 1)[1]
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name != "index.md":
            assert f"]({page.name})" in index, f"docs/index.md's page table lacks {page.name}"
            assert f": {page.name}" in nav, f"mkdocs.yml's nav lacks {page.name}"


def test_every_docs_page_has_its_text():
    """A page opens with its title and holds more than that (an edit that emptied one went unseen once)."""
    for page in PAGES:
        text = page.read_text()
        assert text.startswith("# ") and len(text.splitlines()) > 20, f"{page.name} is empty or has no title"
