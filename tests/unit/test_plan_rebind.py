"""plan.rebind: reading a journal an earlier transaction left, and what the next run does."""

from facts.rebind import RebindJournal, parse_journal
from facts.shared import read_file
from plan.rebind import Journal, journal_of, recovery

T = "2026-12-03T18:40:01Z"


def j(*events: str, running: bool = False) -> Journal:
    return Journal(lines=[f"{T} {e}" for e in events], running=running)


DONE = j("begin tx-1 pid=42", "stopped lxc 200", "stopped qemu 300 api", "move 0000:01:00.0 nvidia vfio-pci",
         "moved 0000:01:00.0 vfio-pci", "bound 0000:01:00.0 vfio-pci", "done")
STATUS = {"lxc": {200: "stopped", 201: "running"}, "qemu": {300: "stopped"}}


def test_a_completed_transaction_s_guests_still_down_are_started_again():
    r = recovery(DONE, STATUS)
    assert r.start == [("lxc", 200), ("qemu", 300)] and r.close
    assert "completed; moved: 0000:01:00.0 -> vfio-pci" in r.lines[0]
    assert r.lines[1].endswith("CT 200, VM 300")


def test_guests_running_again_or_under_ha_are_not_ours_to_start():
    r = recovery(DONE, {"lxc": {200: "running"}, "qemu": {300: "stopped"}}, ha_managed=[("qemu", 300)])
    assert r.start == [] and len(r.lines) == 1


def test_a_rolled_back_transaction_restarted_its_guests_itself():
    journal = j("begin tx-1 pid=42", "stopped lxc 200", "failed 0000:01:00.0 is not bound to vfio-pci", "rollback",
                "restored 0000:01:00.0 nvidia", "restarted lxc 200", "rolledback")
    assert journal.end == "rolledback" and journal.stopped() == []
    r = recovery(journal, STATUS)
    assert r.start == [] and "failed (0000:01:00.0 is not bound to vfio-pci) and was rolled back" in r.lines[0]


def test_an_interrupted_one_is_reported_with_its_last_step_and_its_guests_started():
    journal = j("begin tx-1 pid=42", "stopped lxc 200", "move 0000:01:00.0 nvidia vfio-pci")
    assert journal.end is None
    r = recovery(journal, STATUS)
    assert "was interrupted" in r.lines[0] and "after: move 0000:01:00.0 nvidia vfio-pci" in r.lines[0]
    assert r.start == [("lxc", 200)]


def test_a_running_one_is_not_closed():
    r = recovery(j("begin tx-1 pid=42", "stopped lxc 200", running=True), STATUS)
    assert "is still running" in r.lines[0] and not r.close


def test_carried_guests_count_as_stopped_once():
    journal = j("begin tx-2 pid=43", "stopped lxc 200 carried", "stopped lxc 200", "done")
    assert journal.stopped() == [("lxc", 200)]


def test_no_journal_nothing_to_do():
    r = recovery(Journal(), STATUS)
    assert (r.lines, r.start, r.close) == ([], [], False)


def test_the_fact_parses_its_own_sections():
    out = ["@@ journal", f"{T} begin tx-1 pid=42", f"{T} done", "@@ runner", "idle", "@@ systemd", "yes"]
    parsed = parse_journal(out)
    assert parsed == {"lines": [f"{T} begin tx-1 pid=42", f"{T} done"], "running": False, "systemd": True}
    assert journal_of(parsed).end == "done" and not journal_of(parsed).running
    parsed = parse_journal(["@@ runner", "running", "@@ systemd"])
    assert journal_of(parsed).running and not journal_of(parsed).exists and not parsed["systemd"]
    assert "flock -n" in RebindJournal.command and read_file("/var/lib/pvegpu/rebind/journal") in RebindJournal.command
