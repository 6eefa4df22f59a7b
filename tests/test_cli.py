"""The command line as a user runs it: a real `expertmesh` process, and every command's help
and bad-input path through the real parser."""

import argparse
import os
import subprocess
import sys

import pytest
import yaml

from expertmesh.cli.main import build_parser, main


def _run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "expertmesh.cli.main", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_verify_passes_with_three_groups(tiny_checkpoints, ray_session, capsys):
    """In this process, on the tests' shared Ray (``verify`` as a process of its own, starting its own
    Ray, is test_hub's); it leaves that Ray running and its groups undeployed."""
    from ray import serve

    model = tiny_checkpoints("qwen2_moe")
    code, out, err = _main(["verify", "--model", str(model), "--groups", "3", "--tokens", "16"], capsys)
    assert code == 0, err[-2000:]
    assert out.startswith("PASS qwen2_moe float32 groups=3 tokens=16: max |Δ logits| = ")
    assert "greedy 16 tokens identical" in out
    assert "starting 3 expert groups on Ray Serve" in err, "long steps show progress"
    assert "expertmesh-groups" not in serve.status().applications


def _one_error_line(result):
    assert result.returncode == 2, (result.stdout, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_verify_missing_checkpoint_exits_2_with_one_line(tmp_path):
    line = _one_error_line(_run("verify", "--model", tmp_path / "absent"))
    assert line == f"expertmesh verify: error: checkpoint directory {tmp_path / 'absent'} does not exist"


# The bad inputs below run ``main`` in this process: the same code as the process above, without a
# fresh interpreter importing torch and transformers (~7 s each); the exit status is the process's.


def _one_error_line_in_process(argv, capsys):
    capsys.readouterr()  # not what building the checkpoint printed
    code, _, err = _main(list(map(str, argv)), capsys)
    assert code == 2, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_verify_dense_checkpoint_exits_2(tiny_checkpoints, capsys):
    assert "has no MoE layers" in _one_error_line_in_process(["verify", "--model", tiny_checkpoints("llama")], capsys)


def test_verify_bad_placement_exits_2_before_starting_ray(tiny_checkpoints, tmp_path, capsys):
    placement = tmp_path / "p.yaml"
    placement.write_text(yaml.safe_dump({"groups": {"a": {"*": [0, 1, 2]}}}))
    line = _one_error_line_in_process(
        ["verify", "--model", tiny_checkpoints("mixtral"), "--placement", placement], capsys
    )
    assert "leaves 2 experts unhosted: layer 0 expert 3, layer 1 expert 3" in line


def test_verify_too_many_groups_exits_2(tiny_checkpoints, capsys):
    line = _one_error_line_in_process(["verify", "--model", tiny_checkpoints("mixtral"), "--groups", 5], capsys)
    assert "--groups 5 is more than the 4 experts per layer" in line


# --- the command line as a whole: every command discovered from the parser ---------------------


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) of every command, groups included (``bench``, ``group``), found by walking the
    parser: commands other modules add are walked too."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def _leaf(parser: argparse.ArgumentParser) -> bool:
    return not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)


PARSER = build_parser()
ALL = list(_commands(PARSER))
LEAVES = [(path, parser) for path, parser in ALL if path and _leaf(parser)]


def _main(argv, capsys, run=main):
    try:
        code = run(list(argv))
    except SystemExit as exit:  # --help, --version and argparse's errors exit from inside parse_args
        code = exit.code
    out, err = capsys.readouterr()
    return code, out, err


def _parse(argv):
    """What ``main`` does first, on the one parser built for this module (``main`` builds its own)."""
    PARSER.parse_args(argv)


def test_the_walk_finds_every_command():
    names = {" ".join(path) for path, _ in LEAVES}
    assert {"up", "generate", "verify", "group serve", "bench dispatch", "bench serve", "completion"} <= names
    assert len(names) >= 20


@pytest.mark.parametrize("path", [p for p, _ in ALL], ids=lambda p: " ".join(p) or "expertmesh")
def test_help_of_every_command_documents_every_option(path, capsys):
    parser = dict(ALL)[path]
    code, out, err = _main([*path, "--help"], capsys, run=_parse)
    assert code == 0 and out.startswith("usage: expertmesh") and not err
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"{' '.join(path)} {name} has no help text"
        has_default = action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS)
        if has_default:  # shown, as the help says it or as the formatter adds it
            assert "default" in formatter._get_help_string(action), f"{' '.join(path)} {name} hides its default"


def _bad_value_argv(parser: argparse.ArgumentParser) -> list[str] | None:
    """A value the option's type or choices refuse, for the first such option."""
    for action in parser._actions:
        if not action.option_strings or action.nargs == 0:
            continue
        if action.choices:
            return [action.option_strings[0], "not-a-choice"]
        if action.type in (int, float):
            return [action.option_strings[0], "not-a-number"]
    return None


@pytest.mark.parametrize("path", [p for p, _ in LEAVES], ids=lambda p: " ".join(p))
def test_bad_input_to_every_command_is_one_line_and_exit_2(path, capsys):
    parser = dict(LEAVES)[path]
    for argv in ([*path, "--no-such-option"], [*path, *(_bad_value_argv(parser) or ["--no-such-option"])]):
        code, out, err = _main(argv, capsys, run=_parse)
        assert code == 2, (argv, out, err)
        lines = err.strip().splitlines()
        # argparse reports options nobody knows from the top (``expertmesh: error: unrecognized arguments``)
        assert len(lines) == 1 and lines[0].startswith("expertmesh") and ": error: " in lines[0], (argv, err)
        assert "Traceback" not in err and not out


def test_building_the_parser_imports_no_torch_transformers_or_ray():
    """What keeps ``expertmesh --help`` and completion fast: command modules defer heavy imports."""
    probe = (
        "import sys\nfrom expertmesh.cli.main import build_parser\nbuild_parser()\n"
        "print(sorted(m for m in ('torch', 'transformers', 'ray', 'safetensors') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_version_is_the_package_version(capsys):
    from importlib.metadata import version

    code, out, _ = _main(["--version"], capsys)
    assert code == 0 and out.strip() == f"expertmesh {version('expertmesh')}"


def test_completion_script_and_completions(tmp_path, capsys):
    code, out, _ = _main(["completion", "bash"], capsys)
    assert code == 0 and "complete " in out and "expertmesh" in out
    # what the shell does on <TAB>: run the command with argcomplete's variables and read the answer
    answer = tmp_path / "completions"
    line = "expertmesh up --dt"
    env = {
        **os.environ,
        "_ARGCOMPLETE": "1",
        "_ARGCOMPLETE_IFS": "\n",
        "COMP_LINE": line,
        "COMP_POINT": str(len(line)),
        "_ARGCOMPLETE_STDOUT_FILENAME": str(answer),
    }
    subprocess.run([sys.executable, "-m", "expertmesh.cli.main"], env=env, timeout=120, capture_output=True)
    assert answer.read_text().split() == ["--dtype"]


def test_generate_against_an_unreachable_router_exits_2_with_one_line():
    result = _run("generate", "Hello", "--target", "127.0.0.1:1", timeout=120)
    line = _one_error_line(result)
    assert line.startswith("expertmesh generate: error: 127.0.0.1:1: UNAVAILABLE: ")


def test_progress_bars_show_on_a_terminal_only(monkeypatch):
    """A real pseudo-terminal as stderr: the bar draws there, and not into a pipe or under --quiet."""
    import fcntl
    import io
    import pty
    import select
    import struct
    import termios

    from expertmesh.expert_group import deployment
    from expertmesh.infra import console

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # a fresh pty is 0 columns wide
    with open(follower, "w", closefd=True) as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        shown = console.bar(3, "groups")
        shown.update(3)
        shown.refresh()
        terminal.flush()
        drawn = ""
        while "3/3" not in drawn and select.select([leader], [], [], 30)[0]:  # the first draw says 0/3
            drawn += os.read(leader, 4096).decode()
        assert not shown.disable and "3/3" in drawn
        shown.close()
        console.set_quiet(True)
        try:
            assert console.bar(3, "groups").disable
        finally:
            console.set_quiet(False)
    os.close(leader)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert console.bar(3, "groups").disable
    with deployment.groups_loading(2):  # no terminal: no bar and no watcher thread
        assert not any(t.name == "expertmesh-groups-bar" for t in __import__("threading").enumerate())


def test_quiet_keeps_errors(tmp_path):
    line = _one_error_line(_run("--quiet", "verify", "--model", tmp_path / "absent", timeout=120))
    assert line == f"expertmesh verify: error: checkpoint directory {tmp_path / 'absent'} does not exist"


def _address_option(parser: argparse.ArgumentParser) -> str | None:
    return next((o for a in parser._actions for o in a.option_strings if o in ("--target", "--admin")), None)


def _required(parser: argparse.ArgumentParser, tmp_path) -> list[str]:
    """Some value for every required argument (a number where it takes one)."""
    argv: list[str] = []
    for action in parser._actions:
        value = (
            "0"
            if action.type in (int, float)
            else (action.choices and next(iter(action.choices))) or str(tmp_path / action.dest)
        )
        if action.option_strings and action.required:
            argv += [action.option_strings[0]] + ([] if action.nargs == 0 else [str(value)])
        elif not action.option_strings and action.nargs is None and not isinstance(action, argparse._SubParsersAction):
            argv.append(str(value))
    return argv


CLIENT_COMMANDS = [(p, parser) for p, parser in LEAVES if p[0] != "bench" and _address_option(parser)]


@pytest.mark.parametrize("path", [p for p, _ in CLIENT_COMMANDS], ids=lambda p: " ".join(p))
def test_every_client_command_exits_2_with_one_line_on_bad_input_or_an_unreachable_target(path, tmp_path, capsys):
    """Placeholder values for what the command requires and a target nobody listens on: whichever
    the command refuses first (a missing file, a flag that needs another, the target), it is one
    line and exit 2, never a traceback or a hang."""
    parser = dict(CLIENT_COMMANDS)[path]
    code, _, err = _main([*path, *_required(parser, tmp_path), _address_option(parser), "127.0.0.1:1"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"expertmesh {path[0]}: error: "), err
    assert "Traceback" not in err
