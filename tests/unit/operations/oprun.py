"""Run a pyinfra operation's body on a fake host, for the operation unit tests: what it yields and
the noop reason it gave.

`run_op(op, *args, facts=None, render=text, **kwargs)` calls the generator under the
``@operation`` decorator (``op._inner``) with `args`/`kwargs`, with a pyinfra_testing FakeState and a
FakeHost whose facts are `facts` (``{"module.FactClass": value}``; a fact the operation asks for and
that is not there fails the test; `NO_BUILDS` for one that reports progress). It returns ``(commands, noop)``: each yielded command through
`render`, and ``host.noop_description`` (None when the operation did not call ``host.noop``).

`render` picks how commands come out:
- `text` (the default): a command as the shell would get it (its raw value), or, where a hidden
  value makes the raw and masked forms differ, pyinfra_testing's ``{"raw": …, "masked": …}``; a
  progress-reported command (``operations.progress.reported``) as the command it runs; any other
  ``FunctionCommand`` as yielded.
- ``None``: every command as yielded (``StringCommand``/``FunctionCommand`` objects), for tests that
  look at types, functions and arguments.
- any callable, e.g. ``str`` for the masked text pyinfra logs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pyinfra.api import FunctionCommand
from pyinfra.context import ctx_host, ctx_state
from pyinfra_testing.util import FakeState, create_host, get_command_string

# facts for an operation that reports progress (operations.progress.reported): no build recorded on this host
NO_BUILDS: dict[str, Any] = {"progress.Durations": {}}


def text(command: Any) -> Any:
    """A yielded command as comparable text (see the module docstring)."""
    from operations import progress

    if isinstance(command, str):
        return command
    if isinstance(command, FunctionCommand):
        return command.args[0] if command.function is progress.run_reported else command
    return get_command_string(command)


def run_op(op, *args, facts: dict | None = None, render: Callable[[Any], Any] | None = text,
           **kwargs) -> tuple[list, str | None]:
    """The commands operation `op` yields for `args`/`kwargs` (through `render`) and its noop reason."""
    state = FakeState()
    host = create_host(state, facts=facts)
    with ctx_state.use(state), ctx_host.use(host):
        commands = [c if render is None else render(c) for c in op._inner(*args, **kwargs)]
    return commands, host.noop_description
