"""Read a fact once per host per run.

pyinfra 3 has no fact cache: every `host.get_fact` is another remote command. Stages read
their facts while operations are *generated*, before anything on the host changes, so a
preflight and the applies of several stages can share one reading. Facts that must be read
when an operation *executes* (after earlier operations changed the host) do not go through here.
"""

from __future__ import annotations

from pyinfra import host

_MEMO = "_pvegpu_facts_once"


def fact_once(fact_cls, **kwargs):
    """`host.get_fact(fact_cls, **kwargs)`, remembered for this host for the rest of the run."""
    key = (fact_cls.__module__, fact_cls.__name__, repr(sorted(kwargs.items())))
    memo = dict(host.data.get(_MEMO) or {})  # host.data hands out copies: assign back
    if key not in memo:
        memo[key] = host.get_fact(fact_cls, **kwargs)
        setattr(host.data, _MEMO, memo)
    return memo[key]
