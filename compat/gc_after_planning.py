"""Keep Python's cyclic garbage collector off the objects a run has made once it has planned.

A pvegpu run imports pydantic, jinja2, paramiko, gevent and its own ~70 modules, validates the
spec and plans every stage: hundreds of thousands of objects the collector tracks. CPython runs
full collections over all of them again while the interpreter shuts down (after
`atexit`), and those were the largest part of a no-change run's exit (~0.1 s of ~0.9 s on the
kpro6 twin; a bare `pyinfra fact` makes far fewer objects). The objects live until the process
ends either way.

`keep_planned_objects()` (the last statement of deploy.py, once per host) moves every object
tracked so far into the collector's permanent generation (`gc.freeze`, CPython >= 3.7): later
collections, including the ones at exit, skip them. Objects made afterwards (while pyinfra
executes the operations) are collected as usual. What it gives up: a reference cycle that is
already garbage when it runs is never collected (memory until exit), and a cycle frozen here is
not finalized at exit: a file object in such a cycle that its owner never closed loses what it
still buffers (Python already loses it when the cycle is garbage before exit; pvegpu writes no
local file, and pyinfra closes what it writes with `with` blocks).
"""

from __future__ import annotations

import gc


def keep_planned_objects() -> None:
    """Freeze what the collector tracks now (not counted here: `gc.get_freeze_count` walks the
    whole permanent generation, ~7 ms after a run's planning, once per host)."""
    gc.freeze()
