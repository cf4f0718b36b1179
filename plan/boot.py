"""What the host kernel & IOMMU stage wants, from spec + facts (pure; no I/O).

    desired_params(spec, cpu)                  -> ["amd_iommu=on", "iommu=pt", "pci=realloc"]
    merge_cmdline(existing, desired, spec)     -> "root=ZFS=rpool/ROOT/pve-1 boot=zfs amd_iommu=on …"
    cmdline_difference(configured, booted)     -> {"missing": [...], "extra": [...]}
    preflight_refusals(spec, boot_loader, cpu, sev_snp) -> ["…in words…"]
    grub_dropin_values(grub_files, desired, spec) -> {"GRUB_CMDLINE_LINUX_DEFAULT": "…"}

Parameters are compared the way the kernel reads them: `key=value` words, `key` alone for
flags. The spec owns a few keys outright (the IOMMU ones and the ACS override): a stale value
is replaced in place (`amd_iommu=off` → `amd_iommu=on`), an unwanted `iommu=pt` or
`pcie_acs_override=` is dropped. Every other word (`root=ZFS=…`, `quiet`, user additions)
stays where it is; new words are appended (incident 13: the file that counts depends on the
boot loader, and editing it must not lose what is there).
"""

from __future__ import annotations

import re

from facts.boot import GRUB_DROPIN
from facts.kernel import parse_cmdline_text, parse_grub_defaults
from plan.releases import legacy_cgroup_param
from spec.models import HostSpec

IOMMU_VENDOR_PARAM = {"amd": "amd_iommu=on", "intel": "intel_iommu=on"}
# Words the boot loader adds itself: never part of the configured line.
LOADER_ADDED_KEYS = {"BOOT_IMAGE", "initrd"}
# GRUB adds `root=… ro` itself (grub-mkconfig), so a GRUB config never names them.
GRUB_ADDED_KEYS = {"root", "ro", "rw"}
# `pci=` takes a comma list and the kernel reads every occurrence: merge per option.
OPTION_LIST_KEYS = {"pci"}


def key_of(word: str) -> str:
    return word.split("=", 1)[0].replace('"', "")


def iommu_vendor(spec: HostSpec, cpu: dict | None) -> str | None:
    """`amd` / `intel` from the spec, or from the CPU facts when the spec says `auto`."""
    if spec.iommu.vendor != "auto":
        return spec.iommu.vendor
    vendor = (cpu or {}).get("vendor")
    return vendor if vendor in IOMMU_VENDOR_PARAM else None


def desired_params(spec: HostSpec, cpu: dict | None) -> list[str]:
    """The cmdline words the spec asks for, in a stable order."""
    params: list[str] = []
    vendor = iommu_vendor(spec, cpu)
    if vendor:
        params.append(IOMMU_VENDOR_PARAM[vendor])
    if spec.iommu.passthrough:
        params.append("iommu=pt")
    if spec.iommu.acs_override:
        params.append(f"pcie_acs_override={spec.iommu.acs_override}")
    for word in spec.iommu.params:
        if word not in params:
            params.append(word)
    return params


def _unwanted(word: str, spec: HostSpec, pve_major: int | None = None) -> bool:
    """Words the spec owns and did not ask for, and on Proxmox VE 9 the legacy cgroup layout's
    switch (pve-manager PVE/CLI/pve8to9.pm checklist: `systemd.unified_cgroup_hierarchy=0` fails
    check_containers_cgroup_compat, "support for the hybrid cgroup hierarchy is removed in Proxmox VE 9")."""
    if pve_major is not None and pve_major >= 9 and legacy_cgroup_param([word]):
        return True
    key = key_of(word)
    if key == "iommu" and word.split("=", 1)[-1] == "pt" and not spec.iommu.passthrough:
        return True
    return key == "pcie_acs_override" and not spec.iommu.acs_override


def _merge_option_list(args: list[str], wanted: str) -> bool:
    """Put `pci=<opt>` into the existing `pci=` words (same option name replaced). True if placed."""
    key, _, value = wanted.partition("=")
    names = {opt.split("=", 1)[0]: opt for opt in value.split(",")}
    placed = set()
    for i, word in enumerate(args):
        if key_of(word) != key or "=" not in word:
            continue
        opts = word.split("=", 1)[1].split(",")
        for j, opt in enumerate(opts):
            name = opt.split("=", 1)[0]
            if name in names and name not in placed:
                opts[j] = names[name]
                placed.add(name)
        args[i] = f"{key}={','.join(opts)}"
    missing = [opt for name, opt in names.items() if name not in placed]
    if missing:
        args.append(f"{key}={','.join(missing)}")
    return True


def merge_args(existing: list[str], desired: list[str], spec: HostSpec, pve_major: int | None = None) -> list[str]:
    """`existing` words with `desired` set (in place where the key exists, else appended)."""
    args = [w for w in existing if not _unwanted(w, spec, pve_major)]
    for wanted in desired:
        key = key_of(wanted)
        if key in OPTION_LIST_KEYS and "=" in wanted:
            _merge_option_list(args, wanted)
            continue
        same_key = [i for i, w in enumerate(args) if key_of(w) == key]
        if same_key:
            args[same_key[0]] = wanted
            # later repeats would override ours (the kernel reads the last one)
            args = [w for i, w in enumerate(args) if i not in same_key[1:]]
        else:
            args.append(wanted)
    return args


def merge_cmdline(existing: str | None, desired: list[str], spec: HostSpec, pve_major: int | None = None) -> str:
    """`existing` with `desired` set among the kernel's words; init's words (after a lone `--`,
    facts.kernel.parse_cmdline_text) stay after it, untouched."""
    parsed = parse_cmdline_text(existing or "")
    init = ["--", *parsed["init_args"]] if parsed["init_args"] else []  # a lone trailing `--` passes nothing
    return " ".join(merge_args(parsed["args"], desired, spec, pve_major) + init)


def cmdline_difference(configured: str, booted: str | None, loader: str = "systemd-boot") -> dict:
    """Words the next boot will add (`missing` from the booted line) or drop (`extra`).

    Loader-generated words (BOOT_IMAGE=, initrd=, and for GRUB root=/ro) are not compared.

    .. code:: python

        {"missing": ["amd_iommu=on"], "extra": ["iommu=pt"]}
    """
    ignored = LOADER_ADDED_KEYS | (GRUB_ADDED_KEYS if loader == "grub" else set())
    conf = [w for w in parse_cmdline_text(configured)["args"] if key_of(w) not in ignored]
    boot = [w for w in parse_cmdline_text(booted or "")["args"] if key_of(w) not in ignored]
    return {"missing": [w for w in conf if w not in boot], "extra": [w for w in boot if w not in conf]}


def describe_difference(diff: dict) -> str:
    parts = []
    if diff["missing"]:
        parts.append("the booted cmdline lacks " + " ".join(diff["missing"]))
    if diff["extra"]:
        parts.append("the booted cmdline still has " + " ".join(diff["extra"]))
    return "; ".join(parts)


def preflight_refusals(spec: HostSpec, boot_loader: dict | None, cpu: dict | None, sev_snp: dict | None) -> list[str]:
    """Reasons this stage must not run, in words (empty: go ahead)."""
    refusals: list[str] = []
    if spec.iommu.passthrough and (sev_snp or {}).get("enabled"):
        refusals.append(
            "iommu.passthrough (iommu=pt) is refused: SEV-SNP is enabled on this host (kvm_amd sev_snp=Y) "
            "and SNP needs the IOMMU translating; identity domains there also broke P2P DMA and made "
            "Blackwell GPUs fail to initialise (FSP error 0x177, incidents 7 and 9). Remove "
            "iommu.passthrough or disable SEV-SNP first."
        )
    if spec.iommu.vendor == "auto" and iommu_vendor(spec, cpu) is None:
        found = (cpu or {}).get("vendor") or "nothing"
        refusals.append(
            f"iommu.vendor is auto but the CPU vendor is {found!r}, not AMD or Intel; "
            "set iommu.vendor to amd or intel"
        )
    loader = (boot_loader or {}).get("loader", "unknown")
    if loader == "unknown":
        refusals.append(
            "found neither proxmox-boot-tool ESPs, /etc/kernel/cmdline nor /etc/default/grub, so there is "
            "no file where the kernel command line is configured"
        )
    elif spec.boot_loader != "auto" and spec.boot_loader != loader:
        where = (boot_loader or {}).get("config_file")
        refusals.append(
            f"the spec says boot_loader {spec.boot_loader}, but this host boots with {loader} "
            f"(its cmdline is configured in {where}); editing the {spec.boot_loader} file would have no "
            "effect (incident 13). Fix boot_loader in the spec (or use auto)."
        )
    return refusals


def grub_base_values(grub_files: list[tuple[str, list[str]]]) -> dict[str, str]:
    """GRUB_* values from /etc/default/grub and grub.d snippets sourced before ours.

    `grub_files`: [(path, lines)] in the order grub-mkconfig sources them.
    """
    values: dict[str, str] = {}
    for path, lines in grub_files:
        if path == GRUB_DROPIN:
            break
        values = parse_grub_defaults(lines, values)
    return values


def grub_dropin_values(grub_files: list[tuple[str, list[str]]], desired: list[str], spec: HostSpec,
                       pve_major: int | None = None) -> dict[str, str]:
    """What our grub.d drop-in sets, computed from the files before it (never from itself, so
    an admin's later edit of /etc/default/grub is picked up by the next run).

    GRUB_CMDLINE_LINUX_DEFAULT gets the desired words; GRUB_CMDLINE_LINUX is only rewritten
    when it holds a word the spec owns with another value (it comes first on the line, and
    e.g. amd_iommu=off there would win over our amd_iommu=on).
    """
    base = grub_base_values(grub_files)
    linux = parse_cmdline_text(base.get("GRUB_CMDLINE_LINUX", ""))["args"]
    default = parse_cmdline_text(base.get("GRUB_CMDLINE_LINUX_DEFAULT", ""))["args"]
    desired_keys = {key_of(w) for w in desired} - OPTION_LIST_KEYS
    cleaned_linux = [w for w in linux if not _unwanted(w, spec, pve_major)
                     and not (key_of(w) in desired_keys and w not in desired)]
    values = {"GRUB_CMDLINE_LINUX_DEFAULT": " ".join(merge_args(default, [w for w in desired if w not in cleaned_linux],
                                                                spec, pve_major))}
    if cleaned_linux != linux:
        values["GRUB_CMDLINE_LINUX"] = " ".join(cleaned_linux)
    return values


def grub_configured_cmdline(values: dict[str, str], grub_files: list[tuple[str, list[str]]]) -> str:
    """The line GRUB will boot with once our drop-in is in place (LINUX then DEFAULT)."""
    base = grub_base_values(grub_files)
    linux = values.get("GRUB_CMDLINE_LINUX", base.get("GRUB_CMDLINE_LINUX", ""))
    return " ".join(p for p in (linux, values["GRUB_CMDLINE_LINUX_DEFAULT"]) if p.strip())


def sh_double_quoted(value: str) -> str:
    """`value` inside "…" in a file sh sources (/etc/default/grub.d/*.cfg)."""
    return '"' + re.sub(r'(["\\$`])', r"\\\1", value) + '"'


def vfio_modules(pve_major: int | None) -> list[str]:
    """Modules loaded early so vfio-pci can claim GPUs before nvidia does.

    vfio_virqfd was folded into vfio in kernel 6.2 (PVE 8); listing it there logs an error.
    """
    modules = ["vfio", "vfio_iommu_type1", "vfio_pci"]
    if pve_major is not None and pve_major < 8:
        modules.append("vfio_virqfd")
    return modules
