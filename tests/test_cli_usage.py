"""A bad flag is named with the usage of the subcommand it was given to (its own flags), not the top-level usage of
the service module that runs it (which lists only that module's subcommands)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("module,command,args,flag", [("gateway.cli", "serve", [], "--stagez"),
                                                      ("stage_worker.cli", "make-model", ["--out", "/nonexistent"],
                                                       "--presett")])
def test_an_unknown_flag_gets_the_subcommand_s_usage(module, command, args, flag, capsys):
    import importlib

    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exc:
        main([command, *args, flag, "x"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert f"usage: moepipe {command} " in err and f"unrecognized arguments: {flag} x" in err
    assert "{" not in err.splitlines()[0]          # no "{serve,keys}" subcommand list
