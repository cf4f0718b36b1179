"""CPU vendor, model and the flags that matter for GPU hosts (SEV, virtualisation)."""

from __future__ import annotations

import re

from facts.base import ShellFact

FLAGS_OF_INTEREST = ("svm", "vmx", "sev", "sev_es", "sev_snp", "sme", "hypervisor", "avx512f", "amx_tile")
VENDORS = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}


def parse_cpuinfo(output_lines: list[str]) -> dict | None:
    """Pure parser of the first /proc/cpuinfo block (shape: see `CpuInfo`)."""
    fields: dict[str, str] = {}
    for line in output_lines:
        match = re.match(r"^([^:\t]+?)\s*:\s?(.*)$", line)
        if match and match.group(1) not in fields:
            fields[match.group(1)] = match.group(2).strip()
    if "vendor_id" not in fields and "model name" not in fields:
        return None
    flags = set(fields.get("flags", "").split())
    processors = fields.get("processors")
    return {
        "vendor": VENDORS.get(fields.get("vendor_id", ""), fields.get("vendor_id")),
        "model": fields.get("model name"),
        "flags": [flag for flag in FLAGS_OF_INTEREST if flag in flags],
        "virtualized": "hypervisor" in flags,
        "processors": int(processors) if processors and processors.isdigit() else None,
        # "address sizes : 52 bits physical, 57 bits virtual" (arch/x86/kernel/cpu/proc.c show_cpuinfo)
        "phys_bits": int(m.group(1)) if (m := re.match(r"^(\d+) bits physical", fields.get("address sizes", ""))) else None,
    }


class CpuInfo(ShellFact):
    """
    The host CPU, from the first /proc/cpuinfo block plus the processor count.

    .. code:: python

        {"vendor": "amd",                        # amd | intel | the raw vendor_id
         "model": "AMD EPYC 9354 32-Core Processor",
         "flags": ["svm", "sev", "sev_es", "sev_snp"],   # of FLAGS_OF_INTEREST, present
         "virtualized": False,                   # the `hypervisor` flag: we run in a VM
         "processors": 64,
         "phys_bits": 52}                        # physical address bits (None where not said)
    """

    command = (
        # the first block (awk's paragraph mode: leading empty lines skipped, up to the next empty
        # line), then the count of `processor` lines (what `grep -c '^processor'` counts), one awk
        "awk 'b < 2 { if ($0 == \"\") { if (b) b = 2 } else { b = 1; print } } /^processor/ { n++ } "
        "END { printf \"processors\\t: %d\\n\", n }' /proc/cpuinfo"
    )

    def process(self, output):
        return parse_cpuinfo(output)
