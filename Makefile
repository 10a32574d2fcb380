# Two commands on a fresh machine: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NPROC ?= 4

.PHONY: install system-deps demo test bench observe clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Pinned: a local CPU wheel exists for exactly this version; unpinned torch pulls CUDA packages.
	$(PY) -m pip install --quiet --no-compile torch==2.13.0
	$(PY) -m pip install --quiet --no-compile -e '.[test]'
	# The bytecode once, on every core (pip compiles file by file, on one: ~30 s more of the install here); a
	# file written for a newer Python does not compile, as under pip, and is left as it is
	$(PY) -m compileall -q -j0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') >/dev/null 2>&1 || true
	touch $(STAMP)

install: $(STAMP)

data/demo/train.bin: $(STAMP)
	$(VENV)/bin/phalanx data prepare --demo --out data/demo

# A local cluster of 4 nodes + 1 spare trains the tiny recipe; a node is killed halfway and the job recovers.
demo: $(STAMP) data/demo/train.bin
	rm -rf runs/demo
	OMP_NUM_THREADS=1 $(VENV)/bin/phalanx demo recipes/tiny-llama.yaml --run-dir runs/demo --nodes $(NPROC)

# System packages the tests drive for real: Prometheus scrapes a cluster, headless Chromium opens the dashboard,
# iproute2 makes the network namespaces the multi-host tests use as hosts, slurm-wlm + munge a real Slurm
# (slurmctld and four slurmd on this machine) for the Slurm tests, slurmdbd + mariadb-server its accounting.
# Installed from Debian when running as root (CI is); otherwise they must already be on PATH.
SYSTEM_PACKAGES := prometheus chromium chromium-driver fonts-liberation iproute2 slurm-wlm munge slurmdbd mariadb-server
system-deps:
	@missing=""; for b in prometheus chromium chromedriver ip sbatch slurmctld slurmd munged slurmdbd mariadbd; do command -v $$b >/dev/null || missing="$$missing $$b"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing$$missing (Debian: $(SYSTEM_PACKAGES))"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SYSTEM_PACKAGES) >/dev/null; \
	  else echo "missing$$missing: install the Debian packages $(SYSTEM_PACKAGES) (as root), then run make test again" >&2; exit 1; fi; \
	fi

# The Python and the Debian installs side by side (on a fresh CI machine each takes about a minute).
# Phalanx's bytecode is written first: where PYTHONDONTWRITEBYTECODE is set, every process a test starts (each node's
# worker template, agent and controller) would compile the same modules again.
test:
	$(MAKE) --no-print-directory -j2 $(STAMP) system-deps
	$(PY) -m compileall -q src
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra

# Prometheus (the Debian package) scraping a running cluster's controller: `make observe [CLUSTER=name] [PORT=9090]`.
observe: $(STAMP) system-deps
	$(VENV)/bin/phalanx observe $(if $(CLUSTER),--cluster $(CLUSTER)) --port $(or $(PORT),9090)

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) benchmarks/throughput.py --runs 6 --interleaved-runs 3 --steps 30

clean:
	rm -rf runs data/demo .pytest_cache
