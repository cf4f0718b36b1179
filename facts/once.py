"""Read a fact once per host per run.

pyinfra 3 has no fact cache: every `host.get_fact` is another remote command. Stages read
their facts while operations are *generated*, before anything on the host changes, so a
preflight and the applies of several stages can share one reading. Facts that must be read
when an operation *executes* (after earlier operations changed the host) do not go through here.
"""

from __future__ import annotations

from pyinfra import host

from facts.run_state import nothing_executed, run_state

# Every fact pvegpu reads answers in the C locale, read alone or in the batched probe (whose
# command also starts with facts.hardware.LOCALE_FREE): pyinfra's `_env` exports it before the
# fact's command (pyinfra connectors/util.py make_unix_command), over whatever the session has from
# pam_env's /etc/default/locale, AcceptEnv LANG LC_* or a login shell (issue 43 item 2).
FACT_ENV = {"LC_ALL": "C"}


def read_fact(fact_cls, **kwargs):
    """`host.get_fact(fact_cls, **kwargs)` in the C locale: the one call of pyinfra's fact reader
    (tests/unit/test_fact_locale.py holds every other module to it)."""
    return host.get_fact(fact_cls, _env=FACT_ENV, **kwargs)


def _key(fact_cls, kwargs: dict) -> tuple:
    return (fact_cls.__module__, fact_cls.__name__, repr(sorted(kwargs.items())))


def prefetch(requests) -> int:
    """Read every fact of `requests` (``[(fact class, kwargs)]``) that this host has not read
    yet in ONE remote command (`facts.hardware.combined_probe`: shared sections run once) and
    keep each for `fact_once`. deploy.py calls it twice: with what every stage's
    ``prefetch(spec)`` declares before the preflights, and with their ``prefetch_apply(spec)``
    (which may use the first round's facts) before the applies; a no-change run reads the
    stages' facts in two round trips instead of one per stage and fact. Returns the number of
    remote commands it ran (0 or 1).
    """
    from facts.hardware import combined_probe

    memo = run_state().facts  # the run's readings (facts.run_state)
    todo: dict[tuple, tuple] = {}
    for fact_cls, kwargs in requests:
        key = _key(fact_cls, kwargs)
        if key not in memo:
            todo.setdefault(key, (fact_cls, kwargs))
    if not todo:
        return 0
    if len(todo) == 1:
        (key, (fact_cls, kwargs)), = todo.items()
        memo[key] = read_fact(fact_cls, **kwargs)
    else:
        values = read_fact(combined_probe(list(todo.values())))
        memo.update(zip(todo, values, strict=True))  # combined_probe: one value per request
    return 1


def fact_once(fact_cls, **kwargs):
    """`host.get_fact(fact_cls, **kwargs)`, remembered for this host for the rest of the run
    (or the value `prefetch` read for it)."""
    key = _key(fact_cls, kwargs)
    memo = run_state().facts  # the run's readings (facts.run_state)
    if key not in memo:
        memo[key] = read_fact(fact_cls, **kwargs)
    return memo[key]


def forget(*fact_classes) -> None:
    """Drop this host's readings of `fact_classes` (every kwargs): the next `fact_once` reads them
    again. For a stage that plans again once the run's reboot is over (deploy.py, `after_reboot`)."""
    memo = run_state().facts
    names = {(cls.__module__, cls.__name__) for cls in fact_classes}
    for key in [key for key in memo if key[:2] in names]:
        del memo[key]


def fact_unless_changed(fact_cls, **kwargs):
    """For an operation that reads `fact_cls` when it executes (earlier operations may have changed
    what it reads): the reading `prefetch` took up front while no operation of this run has run a
    command on the host yet (`facts.run_state.nothing_executed`: the host is as read),
    else `host.get_fact` now. A no-change run thus reads it in the prefetch round, not in a
    command of its own; not kept for later readers either way."""
    key = _key(fact_cls, kwargs)
    memo = run_state().facts
    if key in memo and nothing_executed():
        return memo[key]
    return read_fact(fact_cls, **kwargs)
