"""The facts of a converge are the same whatever locale and time style the host's SSH session
has (issue 43 item 2): the kpro6 twin's sessions get a German locale (generated from this
machine's glibc locale sources into the twin, which has apt's and coreutils' German messages)
and another `TIME_STYLE` through sshd's `SetEnv`, as pam_env's /etc/default/locale or a client's
`SendEnv LANG LC_*` give them on a real node; the batched probe and every fact read alone
(facts.once.read_fact, as pyinfra runs it) must give what they gave in the C locale."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from pyinfra.api.command import StringCommand
from pyinfra.connectors.util import make_unix_command

from facts.hardware import combined_probe, fact_command
from facts.once import FACT_ENV
from tests.twin import runtime
from tests.twin.test_probe_programs import _requests, _ssh

pytestmark = [pytest.mark.twin]

LOCALE_SOURCES = Path("/usr/share/i18n/locales/de_DE")
SESSION_ENV = ('SetEnv LANG=de_DE.UTF-8 LC_ALL=de_DE.UTF-8 LANGUAGE=de "TIME_STYLE=+%d.%m.%Y %H:%M"'
               " LS_COLORS=di=01;34 CLICOLOR_FORCE=1\n")


def _alone(fact_class, kwargs) -> str:
    """The command pyinfra runs for `read_fact(fact_class, **kwargs)` (its `_env` exported first)."""
    command = fact_command(fact_class(), (), kwargs)
    return str(make_unix_command(StringCommand(command), _env=FACT_ENV).get_raw_value())


def _values(twin, requests) -> tuple[list, list]:
    probe = combined_probe(requests)
    run = _ssh(twin, str(probe().command))
    assert run.returncode == 0, run.stderr[-2000:]
    together = probe().process(run.stdout.splitlines())
    alone = []
    for fact_class, kwargs in requests:
        done = subprocess.run(runtime.ssh_command(twin.name, [_alone(fact_class, kwargs)]), capture_output=True,
                              text=True, timeout=120)
        lines = done.stdout.splitlines()
        alone.append(fact_class().process(lines) if lines else fact_class().default())
    return together, alone


def test_facts_do_not_depend_on_the_sessions_locale_or_time_style(twin_factory):
    if shutil.which("localedef") is None or not LOCALE_SOURCES.is_file():
        pytest.skip("needs glibc's localedef and its de_DE locale source (Debian: libc-bin, locales)")
    twin = twin_factory("kpro6", name=f"locale-{os.getpid()}")
    assert _ssh(twin, "pct start 200").returncode == 0
    requests = _requests()
    in_c = _values(twin, requests)

    # the German locale, compiled by this machine's glibc (the twin root's is the same bookworm glibc)
    subprocess.run(["localedef", "-i", "de_DE", "-f", "UTF-8", str(Path(twin.root) / "usr/lib/locale/de_DE.UTF-8")],
                   check=True, capture_output=True)
    (Path(twin.root) / "etc/ssh/sshd_config.d/10-session-locale.conf").write_text(SESSION_ENV)
    runtime.kill_sshd(twin.name)  # the listener comes back with the new config within ~1 s
    deadline = time.monotonic() + 30
    while _ssh(twin, "true").returncode == 255 and time.monotonic() < deadline:
        time.sleep(0.3)
    # the session really is German with another time style: collation, messages, ls dates
    seen = _ssh(twin, "printf 'a\\nB\\n' | sort | tr '\\n' ' '; apt-cache policy bash | sed -n 3p; ls -ld /")
    assert seen.stdout.startswith("a B "), seen.stdout
    assert "Installationskandidat" in seen.stdout, seen.stdout
    assert "." in seen.stdout.splitlines()[-1].split()[5], seen.stdout

    in_german = _values(twin, requests)
    names = [fc.__name__ for fc, _ in requests]
    for label, before, after in (("probe", in_c[0], in_german[0]), ("alone", in_c[1], in_german[1])):
        differ = [name for name, b, a in zip(names, before, after, strict=True) if b != a]
        assert not differ, f"{label}: {differ}"
    assert in_german[0] == in_german[1]  # and the probe's values are each fact's own
