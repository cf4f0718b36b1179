"""This machine (@local) as a plain GPU host; spec in h200-vm.yml."""

from pathlib import Path

from spec.load import inventory_hosts

gpu_hosts = inventory_hosts(Path(__file__).with_suffix(".yml"))
