"""The command line's handling of user errors: a GraphrunError prints one message and exits
non-zero, without a traceback unless --debug is given (before the verb or after it)."""

from __future__ import annotations

import signal
import sys

import click

from graphrun.base.errors import GraphrunError, debugging, set_debugging


def exit_quietly() -> None:
    """The run is over (its manifest written): a SIGINT or SIGTERM from here on ends the
    process as the signal does by default, not with a KeyboardInterrupt traceback out of an
    exit handler (a thread pool's, torch's) while the interpreter shuts down."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def fail(err: GraphrunError) -> None:
    """Exit with the user error's one-line message (or raise it under --debug)."""
    if debugging():
        raise err
    click.echo(f"error: {err}", err=True)
    sys.exit(err.exit_code)


def _set_debug(ctx, param, value: bool) -> None:
    # the group's option is parsed first, on every invocation; a verb's may only add to it
    set_debugging(value if ctx.parent is None else (debugging() or value))


# accepted before the verb and after it: `graphrun --debug run x` and `graphrun run x --debug`
debug_option = click.option("--debug", is_flag=True, expose_value=False, is_eager=True,
                            callback=_set_debug,
                            help="Show Python tracebacks for user errors too.")
