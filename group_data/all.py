"""Defaults for every pvegpu host spec.

The spec loader (`spec.load`) merges `PVEGPU_DEFAULTS` *under* each host's own spec before
validation, so a host file only states what differs. pyinfra also loads this file as host data
(each upper-case name below becomes `host.data.<NAME>`); nothing here is secret.
"""

PVEGPU_DEFAULTS: dict = {
    "boot_loader": "auto",
    "iommu": {
        "vendor": "auto",
        "passthrough": False,
        # BAR space for 96 GB cards (incident 10); harmless elsewhere.
        "params": ["pci=realloc"],
        "acs_override": None,
    },
    "nvidia": None,
    "kernel": None,
    "gpus": {},
    "containers": {},
    "vms": {},
    "nccl": {"profile": "auto", "overrides": {}, "services": []},
    "reboot": {"allowed": False},
    "guests": {},  # allow_stop, shutdown_timeout: spec.models.GuestPolicy holds the defaults
    "proxmox_api": None,
    "proxmox_ve": None,  # 8 or 9; 9 on a host still on 8: the run reports the upgrade's to-dos
}
