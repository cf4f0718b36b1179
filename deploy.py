"""pvegpu entry point: converge a Proxmox VE GPU host to its spec.

    pyinfra inventories/kpro6.py deploy.py --dry    # preview
    pyinfra inventories/kpro6.py deploy.py          # converge

The spec was validated when the inventory loaded (spec.load), before any connection. The
stages of DESIGN.md section 2 run in order; a stage that is not built yet is absent, not faked.
"""

from pyinfra import host, logger

from plan.summary import spec_summary

spec = host.data.get("pvegpu_spec")
if spec is None:
    raise SystemExit(
        f"pvegpu: host {host.name} has no spec (host data 'pvegpu_spec'); "
        "use an inventory from inventories/ that loads a .yml spec"
    )

for line in spec_summary(host.name, spec):
    logger.info(line)

# Stages, in order (DESIGN.md section 2). Each is one module under operations/.
STAGES = []  # filled as stages land: (name, callable(spec))

for _name, run_stage in STAGES:
    run_stage(spec)
