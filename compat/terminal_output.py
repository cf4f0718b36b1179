"""pyinfra's printing of a command's output, with control characters escaped (issue 39 item 8).

pyinfra prints what a remote command wrote in two places, as it came: every line of a failed
command (`pyinfra.api.util.print_host_combined_output`, which `pyinfra.api.operations` and
`pyinfra.api.facts` import by name) and, with `-v`/`--debug` output, each line as it arrives
(`pyinfra.connectors.util.read_buffer`, through its `print_func`). A command of pvegpu's may print
text a container controls (`pct exec` stderr, the installer's output, a CT's /etc/nccl.conf
write failing), and a terminal acts on the escape sequences in it. `install()` wraps those
functions where pyinfra looks them up: the lines pvegpu's facts and operations read stay as
they are; only what goes to the terminal passes through `plan.terminal.visible`. The wrappers
call pyinfra's own functions (no copy of them); a pyinfra without them, or whose `read_buffer`
takes no `print_func`, runs stock and the run logs once why.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from typing import Any

from plan.terminal import visible

log = logging.getLogger("pvegpu")

_WRAPPED = "_pvegpu_visible"
_refusal_logged = False


def _modules() -> dict[str, Any]:
    return {name: importlib.import_module(name) for name in
            ("pyinfra.api.operations", "pyinfra.api.facts", "pyinfra.connectors.util")}


def visible_output(output: Any) -> Any:
    """A copy of a pyinfra `CommandOutput` whose lines are `visible`."""
    util = importlib.import_module("pyinfra.connectors.util")
    return util.CommandOutput([util.OutputLine(line.buffer_name, visible(line.line)) for line in output])


def _wrap_print_combined(original):
    @functools.wraps(original)
    def print_host_combined_output(host, output):
        return original(host, visible_output(output))
    setattr(print_host_combined_output, _WRAPPED, original)
    return print_host_combined_output


def _wrap_read_buffer(original):
    @functools.wraps(original)
    def read_buffer(name, io, output_queue, print_output=False, print_func=None):
        def shown(line):
            return print_func(visible(line)) if print_func else visible(line)
        return original(name, io, output_queue, print_output=print_output, print_func=shown)
    setattr(read_buffer, _WRAPPED, original)
    return read_buffer


def refusal(modules: dict[str, Any]) -> str | None:
    """Why the wrappers do not fit this pyinfra, or None."""
    for name in ("pyinfra.api.operations", "pyinfra.api.facts"):
        if not callable(getattr(modules[name], "print_host_combined_output", None)):
            return f"{name} has no print_host_combined_output"
    read_buffer = getattr(modules["pyinfra.connectors.util"], "read_buffer", None)
    if not callable(read_buffer):
        return "pyinfra.connectors.util has no read_buffer"
    params = list(inspect.signature(getattr(read_buffer, _WRAPPED, read_buffer)).parameters)
    if params != ["name", "io", "output_queue", "print_output", "print_func"]:
        return f"pyinfra.connectors.util.read_buffer takes ({', '.join(params)})"
    for cls in ("CommandOutput", "OutputLine"):
        if not hasattr(modules["pyinfra.connectors.util"], cls):
            return f"pyinfra.connectors.util has no {cls}"
    return None


def install() -> bool:
    """Wrap pyinfra's output printing (see the module docstring); True when this call wrapped
    something, False when it was wrapped already or this pyinfra does not fit."""
    global _refusal_logged
    modules = _modules()
    why = refusal(modules)
    if why is not None:
        if not _refusal_logged:
            log.warning("pvegpu: pyinfra prints command output as it comes (control characters not escaped): %s", why)
            _refusal_logged = True
        return False
    done = False
    for name in ("pyinfra.api.operations", "pyinfra.api.facts"):
        current = modules[name].print_host_combined_output
        if not hasattr(current, _WRAPPED):
            modules[name].print_host_combined_output = _wrap_print_combined(current)
            done = True
    util = modules["pyinfra.connectors.util"]
    if not hasattr(util.read_buffer, _WRAPPED):
        util.read_buffer = _wrap_read_buffer(util.read_buffer)
        done = True
    return done
