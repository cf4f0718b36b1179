"""plan.containers: which GPU containers get the host's NVIDIA user space, and why not."""

from plan.containers import installed_versions, plan_userspace
from spec.models import ContainerSpec

CTS = {200: ContainerSpec(gpus=["0000:01:00.0"]), 201: ContainerSpec(gpus=["0000:21:00.0"]),
       202: ContainerSpec(gpus=[])}
LIB = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so."


def state(status=None, containers=None, pct=True, host_root="64:2"):
    return {"pct": pct, "host_root": host_root, "status": status or {}, "containers": containers or {}}


def ct(*versions, root="65:34", arch="x86_64", glibc=True):
    return {"root": root, "arch": arch, "glibc": glibc, "libs": [LIB + v for v in versions]}


def test_versions_come_from_nvml_library_names_only():
    assert installed_versions([LIB + "595.71.05", "/usr/lib64/libnvidia-ml.so.580.95.05",
                               "/usr/lib/x86_64-linux-gnu/libcuda.so.570.1.1", LIB + "1"]) == ["580.95.05", "595.71.05"]


def test_running_containers_without_or_with_another_version_get_an_install():
    steps = plan_userspace("595.71.05", CTS, state({200: "running", 201: "running"},
                                                   {200: ct(), 201: ct("580.95.05")}))
    assert [(s.ctid, s.action) for s in steps] == [(200, "install"), (201, "install")]  # 202 has no GPUs
    assert "has no NVIDIA user space" in steps[0].reason
    assert "580.95.05" in steps[1].reason and "mismatch" in steps[1].reason


def test_exact_version_is_ok_and_two_versions_are_reinstalled():
    steps = plan_userspace("595.71.05", CTS, state({200: "running", 201: "running"},
                                                   {200: ct("595.71.05"), 201: ct("595.71.05", "580.95.05")}))
    assert [(s.ctid, s.action) for s in steps] == [(200, "ok"), (201, "install")]


def test_what_cannot_be_done_now_is_skipped_with_its_reason():
    steps = plan_userspace("595.71.05", CTS, state({200: "stopped"}))
    assert [(s.ctid, s.action) for s in steps] == [(200, "skip"), (201, "skip")]
    assert "stopped" in steps[0].reason and "while it runs" in steps[0].reason
    assert "does not exist" in steps[1].reason

    steps = plan_userspace("595.71.05", CTS, state({200: "running", 201: "running"},
                                                   {200: ct(root="64:2"), 201: ct(glibc=False)}))
    assert "shares the host's root" in steps[0].reason and steps[0].action == "skip"
    assert "no glibc" in steps[1].reason and steps[1].action == "skip"

    assert {s.action for s in plan_userspace("595.71.05", CTS, state(pct=False))} == {"skip"}
    # running, but pct exec gave no answer
    assert "did not answer" in plan_userspace("595.71.05", CTS, state({200: "running"}))[0].reason


def test_only_skips_the_operator_must_act_on_are_warnings():
    steps = plan_userspace("595.71.05", CTS, state({200: "stopped", 201: "running"}, {201: ct(glibc=False)}))
    assert [(s.ctid, s.warn) for s in steps] == [(200, False), (201, True)]
