# pvegpu — every target sets up what it needs on a fresh machine (venv, Debian packages, twin root).
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: venv debs demo test test-unit test-slow lint bench twin-up twin-down clean docs docs-ref

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $@

debs:
	bash scripts/install-debs.sh

# Main job on a built-in twin: start it, preview (--dry), converge, converge again, host checks.
# PROFILE=kpro6 (default: Proxmox VE 8, bookworm) or PROFILE=kpro6-pve9 (Proxmox VE 9.2, trixie).
PROFILE ?= kpro6
demo: venv debs
	PVEGPU_DEMO_PROFILE=$(PROFILE) bash scripts/demo.sh

# All tests (what CI runs): a queue of pytest runs, 3 at a time, the longest first (scripts/run-tests.sh).
test: venv debs
	bash scripts/run-tests.sh $(PYTEST_ARGS)

# ruff, mypy and shellcheck (also the first step of `make test`)
lint: venv debs
	bash scripts/lint.sh

test-unit: venv
	$(VENV)/bin/pytest tests/unit $(PYTEST_ARGS)

# The slow lane, not in `make test` (scripts/run-tests.sh SLOW_LANE): trixie's cold NVIDIA build
# with GCC 14 (~20 min on 2 cores, its twin root built first) and the real 8 -> 9 apt full-upgrade
# on a twin, ~10 min a case warm (Debian's packages cached in .cache/distup/)
test-slow: venv debs
	tests/twin/twinctl cache --suite trixie >/dev/null
	$(VENV)/bin/pytest -p no:cacheprovider tests/e2e/test_driver_build_trixie.py tests/e2e/test_dist_upgrade_e2e.py $(PYTEST_ARGS)

# Generated doc pages: the spec reference from spec/models.py, the stage diagram from operations.STAGES,
# the host checks page from the docstrings of tests/host
# (tests/unit/test_spec_reference.py and test_docs_pages.py compare them with what is committed).
docs-ref: venv
	$(PY) -m spec.reference
	$(PY) scripts/gen_docs.py

# The documentation site, docs/ -> site/ (MkDocs, strict: a broken link or a missing page fails; offline).
docs: venv
	$(VENV)/bin/mkdocs build --strict

bench: venv debs
	$(PY) bench/run.py

# Start/stop the kpro6 twin by hand (then: PVEGPU_TWINS=kpro6 .venv/bin/pyinfra inventories/twin.py deploy.py --dry)
twin-up: venv debs
	tests/twin/twinctl start kpro6 --profile kpro6

twin-down:
	tests/twin/twinctl stop kpro6

clean:
	-for t in .twin/*/twin.json; do [ -e "$$t" ] && tests/twin/twinctl stop "$$(basename $$(dirname $$t))"; done
	rm -rf $(VENV) .twin
