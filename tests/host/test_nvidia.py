"""Host checks of the NVIDIA driver and module-options stages (incidents 2, 3, 5, 6).

Run: pytest tests/host --inventory inventories/<site>.py  (fixture `target` from conftest.py:
.name, .spec (HostSpec), .host (testinfra), .run(cmd) -> (rc, stdout)).
"""

from __future__ import annotations

import re

import pytest

from facts.nvidia import SHIM_VALIDATION_OFF
from plan import nvidia as nvplan

MODPROBE_CONF = "/etc/modprobe.d/pvegpu-nvidia.conf"
NODES_UNIT = "/etc/systemd/system/pvegpu-nvidia-nodes.service"
NODES_WANTS = "/etc/systemd/system/multi-user.target.wants/pvegpu-nvidia-nodes.service"


def nvidia_spec(target):
    if target.spec.nvidia is None:
        pytest.skip(f"{target.name}: the spec manages no NVIDIA driver")
    return target.spec.nvidia


def needs_nvidia_driver(target) -> bool:
    return any(gpu.driver == "nvidia" for gpu in target.spec.gpus.values())


def host_gpu_ids(target) -> dict[str, str]:
    _, out = target.run(
        "for d in /sys/bus/pci/devices/*; do "
        'echo "${d##*/} $(cat $d/vendor) $(cat $d/device) $(cat $d/class)"; done 2>/dev/null')
    pci = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4:
            pci[parts[0]] = {"vendor": parts[1].removeprefix("0x"), "device": parts[2].removeprefix("0x"),
                             "class": parts[3].removeprefix("0x")}
    return nvplan.nvidia_gpu_ids(pci)


def test_module_firmware_and_userspace_versions_are_equal(target):
    """Modules, firmware and user space are one version (incident 2)."""
    nv = nvidia_spec(target)
    _, running = target.run("uname -r")
    _, loaded = target.run("cat /proc/driver/nvidia/version 2>/dev/null")
    match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", loaded)
    for release in nv.releases or [running.strip()]:  # the spec's build targets, else the running kernel
        _, module = target.run(f"modinfo -k {release} -F version nvidia 2>/dev/null")
        module = module.strip()
        if not module and match and release == running.strip():
            # a driver runs, but nothing under /lib/modules/<release> provides it (a module loaded by
            # path or from another tree, as on the recorded H200 host): say so, not "none"
            pytest.fail(
                f"{target.name}: the running kernel {release} has the NVIDIA driver {match.group(1)} loaded, but "
                f"no nvidia module under /lib/modules/{release} (modinfo -k {release} nvidia finds none): the "
                f"loaded one came from elsewhere, so the next boot has no driver; the spec wants {nv.version} "
                f"installed there", pytrace=False)
        assert module == nv.version, (
            f"{target.name}: kernel {release} has nvidia module {module or 'none'}, but the spec wants {nv.version}")
    if not match or match.group(1) != nv.version:
        # a reboot loads the installed modules only if the kernel the loader boots next has them
        # (plan.reboot.next_boot_without_modules, the reboot stage's own guard)
        gap = next_boot_gap(target, nv)
        loaded = f"the loaded NVIDIA driver is {match.group(1)}" if match else "no NVIDIA module is loaded"
        assert not (gap and (match or needs_nvidia_driver(target))), (
            f"{target.name}: {loaded}, and the next boot ({'; '.join(f'{w}: {r}' for w, r in gap)}) has no nvidia "
            f"{nv.version} modules (built for {', '.join(nv.releases or [running.strip()])}), so a reboot does not load "
            f"them either; add {', '.join(dict.fromkeys(r for _, r in gap))} to nvidia.releases (or leave it out) and re-run")
    if match:
        assert match.group(1) == nv.version, (
            f"{target.name}: the loaded NVIDIA driver is {match.group(1)}, the installed modules are {nv.version}; "
            f"a reboot is pending")
    if nv.firmware:
        rc, _ = target.run(f"ls /lib/firmware/nvidia/{nv.version}/gsp*.bin")
        assert rc == 0, (f"{target.name}: no GSP firmware for {nv.version} in /lib/firmware/nvidia/{nv.version}/; "
                         f"firmware of another version panicked a boot (incident 2)")
    _, libs = target.run("ls /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.* /usr/lib64/libnvidia-ml.so.* "
                         "/usr/lib/libnvidia-ml.so.* 2>/dev/null")
    versions = nvplan.userspace_versions(libs.split())
    assert all(v == nv.version for v in versions), (
        f"{target.name}: user space {', '.join(versions)} differs from the {nv.version} modules "
        f"(driver/library version mismatch, incident 6)")


def test_uvm_hmm_is_disabled_where_asked(target):
    """`uvm_disable_hmm` is in effect where asked (incident 3)."""
    nv = nvidia_spec(target)
    wanted, why = nvplan.uvm_disable_hmm(nv.uvm_disable_hmm, host_gpu_ids(target))
    if not wanted:
        pytest.skip(f"{target.name}: uvm_disable_hmm not asked ({why})")
    rc, value = target.run("cat /sys/module/nvidia_uvm/parameters/uvm_disable_hmm")
    assert rc == 0 and value.strip() == "Y", (
        f"{target.name}: nvidia_uvm runs with uvm_disable_hmm={value.strip() or 'unloaded'} but should be Y "
        f"({why}); CUDA init fails in containers without it")


def test_modprobe_config_carries_the_option(target):
    """The modprobe configuration carries the options."""
    nv = nvidia_spec(target)
    wanted, why = nvplan.uvm_disable_hmm(nv.uvm_disable_hmm, host_gpu_ids(target))
    _, config = target.run("modprobe -c 2>/dev/null | grep -E '^options (nvidia|nvidia_uvm) '")
    has = bool(re.search(r"^options nvidia_uvm .*\buvm_disable_hmm=1\b", config, re.M))
    assert has == wanted, (
        f"{target.name}: modprobe -c {'lacks' if wanted else 'has'} 'options nvidia_uvm uvm_disable_hmm=1' "
        f"({why})")
    for key, value in sorted(nv.nvreg.items()):
        option = f"{key}={nvplan.modprobe_value(value)}"
        assert re.search(rf"^options nvidia .*{re.escape(option)}", config, re.M), (
            f"{target.name}: modprobe -c lacks 'options nvidia {option}' from the spec")


def test_uvm_device_node_exists(target):
    """`/dev/nvidia-uvm` exists (incident 5)."""
    nvidia_spec(target)
    if not needs_nvidia_driver(target):
        pytest.skip(f"{target.name}: no GPU uses the nvidia driver")
    rc, _ = target.run("test -c /dev/nvidia-uvm")
    assert rc == 0, (
        f"{target.name}: /dev/nvidia-uvm is missing; containers with GPUs will not start (incident 5)")


def test_device_node_unit_is_enabled_before_guests(target):
    """The device-node unit runs before `pve-guests.service`."""
    nvidia_spec(target)
    unit = target.host.file(NODES_UNIT)
    assert unit.exists, f"{target.name}: {NODES_UNIT} is missing; /dev/nvidia-uvm is not made at boot (incident 5)"
    link = target.host.file(NODES_WANTS)
    assert link.is_symlink and link.linked_to == NODES_UNIT, (
        f"{target.name}: pvegpu-nvidia-nodes.service is not enabled for multi-user.target")
    before = [word for line in unit.content_string.splitlines() if line.startswith("Before=")
              for word in line.split("=", 1)[1].split()]
    assert "pve-guests.service" in before, (
        f"{target.name}: pvegpu-nvidia-nodes.service is not ordered before pve-guests.service")


def test_loaded_module_was_built_by_the_running_kernels_compiler(target):
    """The loaded module was built by the running kernel's compiler (incident 1).

    Incident 1: modules built by another GCC than their kernel bricked a host."""
    from facts.kernel import KernelToolchain
    from facts.nvidia import NvidiaDriver, parse_driver_version

    _, out = target.run(NvidiaDriver.command)
    driver = parse_driver_version(out.splitlines())
    if driver is None or not driver.get("gcc"):
        pytest.skip(f"{target.name}: no NVIDIA module is loaded (or it names no compiler)")
    _, out = target.run(KernelToolchain().command())
    kernel_gcc = (KernelToolchain().process(out.splitlines()).get("running") or {}).get("gcc")
    assert kernel_gcc, f"{target.name}: /proc/version names no GCC; the kernel's compiler is unknown"
    assert driver["gcc"] == kernel_gcc, (
        f"{target.name}: the loaded nvidia {driver['version']} module was built by gcc {driver['gcc']}, "
        f"the running kernel by gcc {kernel_gcc}; rebuild the modules with the kernel's compiler")


OPEN_MODULES = ("nvidia", "nvidia-uvm", "nvidia-modeset", "nvidia-drm", "nvidia-peermem")


def driver_state(target, nv):
    from facts.nvidia import NvidiaHostState

    _, running = target.run("uname -r")
    releases = list(nv.releases or [running.strip()])
    return releases, target.fact(NvidiaHostState, tuple(releases))  # the cache key must hash


def next_boot_gap(target, nv) -> list[tuple[str, str]]:
    """[(where, release)] the loader boots next without nvidia `nv.version`'s modules (plan.reboot)."""
    from facts.loader import LoaderState
    from plan.reboot import next_boot_without_modules

    releases, state = driver_state(target, nv)
    return next_boot_without_modules(nv.version, releases, state, target.fact(LoaderState))


def test_toolchain_matches_each_kernel(target):
    """The gcc (and g++) of each target kernel's compiler are installed.

    The gcc (and, for the open tree, the g++) that match each target kernel's compiler are there (incident 1)."""
    nv = nvidia_spec(target)
    releases, state = driver_state(target, nv)
    for release in releases:
        info = state["releases"].get(release) or {}
        if not info.get("headers"):
            continue  # the version check above says what is missing
        toolchain = nvplan.toolchain_for(release, info.get("cc_version_text"), state["compilers"], need_cxx=nv.open)
        assert toolchain["refusal"] is None, f"{target.name}: {toolchain['refusal']}"


def test_modules_are_signed_where_secure_boot_needs_it(target):
    """With Secure Boot on or `nvidia.signing` set, every module is signed.

    With Secure Boot on or nvidia.signing set, every installed NVIDIA module carries a signature."""
    nv = nvidia_spec(target)
    releases, state = driver_state(target, nv)
    if nv.signing is None and not state.get("secure_boot"):
        why = ("Secure Boot validation is disabled in shim (MokSBState): the kernel does not enforce signatures"
               if state.get("secure_boot_state") == SHIM_VALIDATION_OFF else "Secure Boot is off")
        pytest.skip(f"{target.name}: {why} and the spec signs nothing")
    signer = None
    if nv.signing is not None:
        _, subject = target.run(f"openssl x509 -noout -subject -nameopt multiline -in {nv.signing.cert} -inform DER 2>/dev/null "
                                f"|| openssl x509 -noout -subject -nameopt multiline -in {nv.signing.cert} 2>/dev/null")
        match = re.search(r"commonName\s*=\s*(.+)", subject)
        signer = match.group(1).strip() if match else None
    for release in releases:
        for module in OPEN_MODULES:
            rc, found = target.run(f"modinfo -k {release} -F filename {module} 2>/dev/null")
            if rc != 0 or not found.strip():
                continue
            _, signed = target.run(f"modinfo -k {release} -F signer {module} 2>/dev/null")
            assert signed.strip(), (
                f"{target.name}: {module} for kernel {release} is not signed"
                + (" while Secure Boot is on: the kernel will refuse to load it" if state.get("secure_boot") else ""))
            if signer:
                assert signed.strip() == signer, (
                    f"{target.name}: {module} for kernel {release} is signed by {signed.strip()!r}, not by the spec's "
                    f"certificate {nv.signing.cert} ({signer!r})")
    if nv.signing is not None:
        # a signer name verifies nothing: the kernel loads the modules only if it trusts the cert
        from facts.nvidia import NvidiaHostState

        signed_state = target.fact(NvidiaHostState, tuple(releases), None, (nv.signing.key, nv.signing.cert))
        configs = {r: ((signed_state.get("releases") or {}).get(r) or {}).get("config") or {} for r in releases}
        sources = nvplan.enforcement_sources(signed_state.get("secure_boot"), signed_state.get("sig_enforce"), configs)
        mok = signed_state.get("mok")
        assert not (sources and mok in nvplan.MOK_WORDS), (
            f"{target.name}: the modules are signed with {nv.signing.cert}, which {nvplan.MOK_WORDS.get(mok, '')}; "
            f"{'; '.join(sources)}, so the kernel refuses them ('Key was rejected by service')")


def test_gsp_firmware_for_each_gpu_generation(target):
    """Each GPU's GSP firmware file is there.

    Each GPU's GSP firmware file (by generation: Blackwell/Hopper/Ada/GA10x load gsp_ga10x.bin,
    Turing/GA100 gsp_tu10x.bin) is there in exactly the module version (incident 2)."""
    nv = nvidia_spec(target)
    if not nv.firmware:
        pytest.skip(f"{target.name}: the spec manages no GSP firmware")
    needed = nvplan.needed_gsp_firmware(host_gpu_ids(target))
    if not needed:
        pytest.skip(f"{target.name}: no NVIDIA GPU with GSP firmware found")
    for name, gpus in needed.items():
        rc, _ = target.run(f"test -s /lib/firmware/nvidia/{nv.version}/{name}")
        assert rc == 0, (f"{target.name}: /lib/firmware/nvidia/{nv.version}/{name} is missing, but "
                         f"{', '.join(gpus)} load it when the {nv.version} driver starts; firmware of another "
                         f"version panicked a boot (incident 2)")
