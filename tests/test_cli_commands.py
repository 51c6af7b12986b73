"""`trillion`'s commands are listed once (trainer/cli/main.py COMMANDS): the help shows each, each
names a module with a `main`, and an unknown command is refused with the list."""

import importlib

from trillion.trainer.cli.main import COMMANDS, main


def test_every_command_is_in_the_help_and_has_an_entry_point(capsys):
    assert main(["--help"]) == 0
    shown = capsys.readouterr().out
    for name, command in COMMANDS.items():
        assert f"  {name} " in shown and command.summary in shown
        assert callable(importlib.import_module(command.module).main)


def test_an_unknown_command_exits_2_with_the_list(capsys):
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and all(name in err for name in COMMANDS)
