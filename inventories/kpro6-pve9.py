"""Inventory for the reference host kpro6 on Proxmox VE 9.2 (trixie); its spec lives in kpro6-pve9.yml next to this file.

    pyinfra inventories/kpro6-pve9.py deploy.py --dry

The spec is validated while this file loads, before pyinfra connects anywhere.
"""

from pathlib import Path

from spec.load import inventory_hosts

gpu_hosts = inventory_hosts(Path(__file__).with_suffix(".yml"))
