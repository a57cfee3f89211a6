# The two commands: `make demo` runs a local 3-node mesh, `make test` runs the suite.
# Both create .venv and install everything (torch pinned to the local CPU wheel).
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)

.PHONY: demo test unit lint fuzz bench-all bench bench-dht bench-crdt bench-shards bench-pmtu bench-cli soak clean coturn miniupnpd nftables

demo: $(STAMP)
	$(VENV)/bin/python examples/demo.py

test: $(STAMP) coturn miniupnpd nftables lint
	$(VENV)/bin/python -m pytest -q

# The fast layer alone: no sockets, no processes but two import checks, under a minute (two workers, one per
# core; worksteal: the slowest tests come last in no fixed order, so an idle worker takes them from the busy one).
unit: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 --dist worksteal tests/unit

# Layers point down, services stay apart, no import cycles (contracts in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/lint-imports

# Coverage-guided fuzzing of every decoder of peer data (atheris, 35 MB, not in the default install).
FUZZ_SECONDS ?= 60
fuzz: $(STAMP)
	$(VENV)/bin/pip install -q atheris==3.0.0
	$(VENV)/bin/python tests/fuzz/run.py all --seconds $(FUZZ_SECONDS)

# The chaos soak: 30 daemons on loopback and 5 in the NAT lab (root), SIGKILLs and cut links, then checks.
soak: $(STAMP)
	$(VENV)/bin/python benchmarks/soak.py $(SOAK_ARGS)

# Every benchmark, one after another, into docs/benchmarks.md with plots (about an hour; --quick: minutes).
bench-all: $(STAMP)
	$(VENV)/bin/python benchmarks/all.py

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/rpc.py

bench-dht: $(STAMP)
	$(VENV)/bin/python benchmarks/dht.py

bench-crdt: $(STAMP)
	$(VENV)/bin/python benchmarks/crdt.py

bench-shards: $(STAMP)
	$(VENV)/bin/python benchmarks/lane.py
	$(VENV)/bin/python benchmarks/shards.py

bench-pmtu: $(STAMP)
	$(VENV)/bin/python benchmarks/pmtu.py

bench-cli: $(STAMP)
	$(VENV)/bin/python benchmarks/cli.py

$(STAMP): pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -c constraints.txt -e '.[torch,test,bench]'
	rm -f $(VENV)/.installed-*
	touch $@

# coturn is the STUN server the interop test runs against (Debian package; needs root).
coturn:
	@command -v turnserver >/dev/null 2>&1 || { \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq coturn >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq coturn >/dev/null 2>&1; } || \
	  echo "could not install coturn: its interop test will be skipped"; }

# nftables and conntrack build the NAT lab's routers in network namespaces (needs root).
miniupnpd:
	@command -v miniupnpd >/dev/null 2>&1 || { \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq miniupnpd-nftables >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq miniupnpd-nftables >/dev/null 2>&1; } || \
	  echo "could not install miniupnpd: the UPnP/PCP gateway tests will be skipped"; }

nftables:
	@{ command -v nft && command -v conntrack; } >/dev/null 2>&1 || { \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq nftables conntrack >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq nftables conntrack >/dev/null 2>&1; } || \
	  echo "could not install nftables/conntrack: the NAT lab tests will fail"; }

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
