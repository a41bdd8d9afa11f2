"""``hpc-horovod ... --help``: the help texts that come from docstrings show no reST markup."""

import pytest

from hpc_horovod.cli import build_parser, plain


def test_plain_drops_rest_markup():
    assert plain("run it as ``srun hpc-horovod doctor`` or `srun`") == \
        "run it as srun hpc-horovod doctor or srun"
    assert plain(":func:`~hpc_horovod.slurm.submit` and :data:`a.B`") == "submit and a.B"
    assert plain("no markup: 'quoted' %x-%j.out") == "no markup: 'quoted' %x-%j.out"


def _commands():
    parser = build_parser()
    (action,) = [a for a in parser._actions if a.dest == "subcommand"]
    return parser, action.choices


@pytest.mark.parametrize("name", sorted(_commands()[1]))
def test_no_backticks_in_help(name, capsys):
    parser, commands = _commands()
    with pytest.raises(SystemExit):
        parser.parse_args([name, "--help"])
    out = capsys.readouterr().out
    assert out.startswith(f"usage: hpc-horovod {name}") and "`" not in out, out
    assert "`" not in parser.format_help()


def test_a_command_line_error_is_one_line_and_a_pointer_to_help(capsys):
    from hpc_horovod.cli import main

    with pytest.raises(SystemExit) as info:
        main(["no-such-command"])
    err = capsys.readouterr().err.splitlines()
    assert info.value.code == 2 and not any(line.startswith("usage:") for line in err), err
    assert err[0].startswith("hpc-horovod: error: argument COMMAND: invalid choice: "
                             "'no-such-command'"), err
    assert err[1:] == ["(hpc-horovod --help lists the options)"], err
