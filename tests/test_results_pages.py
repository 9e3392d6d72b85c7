"""The results pages (docs/results/*.md): each names the commit that recorded its figures and a
date, and its commands are ones that exist — every ``lowcomm`` command parsed by the CLI's own
click parser (commands, options, values and the folders they read), every ``make`` target in
the Makefile, every extra of a ``pip install -e .[EXTRAS]`` in setup.cfg, every script on disk,
and a folder a command reads made by an earlier command of the page. Nothing is run."""
import configparser
import os
import re
import shlex
import subprocess
from pathlib import Path

import click
import pytest

from conftest import ROOT, experiment

PAGES = sorted(p for p in (ROOT / "docs" / "results").glob("*.md") if p.name != "index.md")
RECORDED = re.compile(r"^\*Figures recorded in commits? (.*)\*$", re.M)
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
FENCE = re.compile(r"^```bash\s*\n(.*?)^```", re.M | re.S)
SEPARATORS = {";", "&&", "||", "|", "do", "done", "then", "fi"}
# what `make TARGET` leaves for a later command to read (checked against the Makefile below)
MAKE_WRITES = {"demo": "runs/demo", "bench": "runs/bench/data"}
MADE = ".written-by-make"


def commands(block: str) -> list[list[str]]:
    """The simple commands of a bash block, in order, with ``$VAR`` expanded (an assignment's
    value; a ``for`` loop's first value) and the launcher prefixes kept."""
    out, env = [], {}
    for line in block.replace("\\\n", " ").splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lex.whitespace_split, lex.commenters = True, "#"
        words = []
        for tok in [*lex, ";"]:
            if tok in SEPARATORS:
                if words:
                    out.append(words)
                words = []
            else:
                words.append(tok)
    expanded = []
    for words in out:
        if words[0] == "for" and len(words) > 3 and words[2] == "in":
            env[words[1]] = words[3]
            continue
        if len(words) == 1 and re.fullmatch(r"\w+=.*", words[0]):
            name, value = words[0].split("=", 1)
            env[name] = value
            continue
        cmd = []
        for w in words:
            m = re.fullmatch(r"\$\{?(\w+)\}?", w)
            if m and m.group(1) in env:
                cmd += shlex.split(env[m.group(1)])      # unquoted: split into words
            else:
                cmd.append(re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), w))
        expanded.append(cmd)
    return expanded


def strip_prefix(cmd: list[str]) -> list[str]:
    """The command a launcher or an environment assignment runs."""
    while cmd:
        if re.fullmatch(r"\w+=.*", cmd[0]):                       # VAR=value command
            cmd = cmd[1:]
        elif cmd[0] in ("launchers/local.sh", "launchers/horovodrun.sh", "launchers/wan.sh"):
            assert (ROOT / cmd[0]).exists(), cmd[0]
            cmd = cmd[1:]
            while cmd and cmd[0] in ("-n", "--np", "--dcs"):
                cmd = cmd[2:]
        elif cmd[0] == "flock":                                   # flock LOCKFILE command
            cmd = cmd[2:]
        else:
            return cmd
    return cmd


def check_lowcomm(args: list[str], where: str) -> None:
    """``lowcomm ARGS`` parsed by the CLI's click groups and commands, as ``lowcomm`` parses it
    (an unknown command or option, a bad value, a missing folder raise); ``--out`` folders and
    ``--json`` files are made for the commands after it."""
    from lowcomm.cli.main import cli
    cmd, name, parent, line = cli, "lowcomm", None, " ".join(args)
    try:
        while True:
            ctx = cmd.make_context(name, list(args), parent=parent)
            if not isinstance(cmd, click.Group):
                break
            rest = [*ctx._protected_args, *ctx.args] if hasattr(ctx, "_protected_args") \
                else [*ctx.protected_args, *ctx.args]
            name, cmd, args = cmd.resolve_command(ctx, rest)
            parent = ctx
    except click.ClickException as e:
        raise AssertionError(f"{where}: lowcomm {line}: {e.format_message()}") from None
    out, js = ctx.params.get("out"), ctx.params.get("json_path")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
    if js:
        Path(js).parent.mkdir(parents=True, exist_ok=True)
        Path(js).touch()


def check_command(cmd: list[str], where: str) -> None:
    cmd = strip_prefix(cmd)
    assert cmd, f"{where}: an empty command"
    if cmd[0] == "lowcomm":
        return check_lowcomm(cmd[1:], where)
    if cmd[:3] == ["python", "-m", "lowcomm.cli"]:
        return check_lowcomm(cmd[3:], where)
    if cmd[0] == "make":
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
        for t in (w for w in cmd[1:] if "=" not in w and not w.startswith("-")):
            assert t in targets, f"{where}: make {t}: no such target in the Makefile"
            if t in MAKE_WRITES:                 # a folder of files a later command may read
                Path(MAKE_WRITES[t]).mkdir(parents=True, exist_ok=True)
                (Path(MAKE_WRITES[t]) / MADE).touch()
        return
    if cmd[0] == "python" and cmd[1:2] == ["experiments/results_pages.py"]:
        mod = experiment("results_pages")
        try:
            a = mod.parser().parse_args(cmd[2:])
        except SystemExit:
            raise AssertionError(f"{where}: {' '.join(cmd)}: experiments/results_pages.py "
                                 "refuses these arguments") from None
        read = getattr(a, mod.READS.get(a.cmd, ""), None)
        assert read is None or read.exists() or any((d / MADE).exists() for d in read.parents), \
            f"{where}: {' '.join(cmd)} reads {read}, which no command before it on the page makes"
        return
    if cmd[:3] == ["pip", "install", "-e"]:
        m = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", cmd[3] if len(cmd) == 4 else "")
        assert m, f"{where}: {' '.join(cmd)}: only `pip install -e .[EXTRAS]` of this project"
        cfg = configparser.ConfigParser()
        cfg.read(ROOT / "setup.cfg")
        for extra in filter(None, (m.group(1) or "").split(",")):
            assert cfg.has_option("options.extras_require", extra), \
                f"{where}: {' '.join(cmd)}: setup.cfg has no extra {extra!r}"
        return
    script = cmd[1] if cmd[0] in ("python", "sbatch", "bash") else cmd[0]
    assert script.endswith((".py", ".sh", ".sbatch")) and (ROOT / script).is_file(), \
        f"{where}: {' '.join(cmd)}: not a lowcomm, make or repository-script command"


def page_commands(page: Path) -> list[list[str]]:
    return [c for block in FENCE.findall(page.read_text()) for c in commands(block)]


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_results_page_names_its_commit_date_and_commands_that_exist(page, tmp_path, monkeypatch):
    text = page.read_text()
    line = RECORDED.search(text)
    assert line, f"{page.name}: no '*Figures recorded in commit `HASH` (DATE).*' line"
    commits = re.findall(r"`([0-9a-f]{7,40})`", line.group(1))
    assert commits, f"{page.name}: its 'recorded in' line names no commit"
    assert DATE.search(line.group(1)), f"{page.name}: its 'recorded in' line has no date (YYYY-MM-DD)"
    if (ROOT / ".git").exists():
        for c in commits:
            r = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{c}^{{commit}}"],
                               capture_output=True)
            assert r.returncode == 0, f"{page.name}: commit {c} is not in this repository"
    cmds = page_commands(page)
    assert cmds, f"{page.name}: no command"
    for name in ("experiments", "launchers", "tests", "scripts", "docs", "Makefile"):
        os.symlink(ROOT / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)             # the folders the commands make, made here
    for cmd in cmds:
        check_command(cmd, page.name)


def test_the_checker_catches_what_it_is_for(tmp_path, monkeypatch):
    """A folder no earlier command makes, an unknown option, a bad value, an unknown make
    target and a script that is not there are each refused."""
    monkeypatch.chdir(tmp_path)
    assert commands("F=\"--steps 3\"\nfor K in 2 4; do launchers/local.sh -n $K lowcomm "
                    "train $F; done  # x") == [["launchers/local.sh", "-n", "2", "lowcomm",
                                               "train", "--steps", "3"]]
    for bad in ("lowcomm project runs/nowhere", "lowcomm compare --no-such-option 1",
                "lowcomm compare --np zero", "lowcomm bench nothing", "make no-such-target",
                "python experiments/no_such_script.py",
                "python experiments/results_pages.py export-compare runs/x out.json"):
        with pytest.raises(AssertionError):
            check_command(shlex.split(bad), "test")
    good = ("lowcomm compare --np 4 --methods main --steps 300 --out runs/x\n"
            "lowcomm project runs/x --params 1e9\n"
            "python experiments/results_pages.py export-compare runs/x out.json")
    for c in commands(good):                # the folder read is the one made before: accepted
        check_command(c, "test")
    makefile = (ROOT / "Makefile").read_text() + (ROOT / "scripts" / "bench.sh").read_text()
    assert "DEMO_OUT ?= runs/demo" in makefile and "OUT=${OUT:-$DIR/data}" in makefile
