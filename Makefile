# c10m: the two commands are `make demo` and `make test` (see README.md).
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

CLUSTER ?= local
CARGO ?= cargo
export C10M_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/c10m
export C10M_STATE ?= $(C10M_CACHE)/cluster
LOCAL_KUBECONFIG := $(C10M_STATE)/kubeconfig
OPERATOR := target/debug/c10m-operator
# The operator's modules from the leaves up: none may import one listed after it.
OPERATOR_LAYERS := names,unmanaged,reason,events,telemetry,promql,policy,api,plan,render,autoscale,rollout,status,calibrate,reconcile,controller,leader,table

.PHONY: help deps build images cluster-up demo down test test-unit lint crd measure-server

help:
	@echo "make demo              local control plane + operator + example fleet (CLUSTER=current: your kubectl context)"
	@echo "make down              stop the demo operator and the local control plane"
	@echo "make images            server + operator images, FROM scratch, built offline (buildah) into \$$C10M_CACHE/images/*.tar"
	@echo "make test              alert-rule unit tests (promtool), unit, property and end-to-end tests (brings the plane up and down itself)"
	@echo "make lint              cargo fmt --check, cargo clippy -D warnings, module layers, promtool check rules, gofmt + go vet (tools/goecho), helm lint"
	@echo "make crd               regenerate crds/connectionfleet.yaml from the Rust types"
	@echo "make measure-server    c10m-server memory per idle connection, one process (JSON)"
	@echo "make bench-server      c10m-server vs tokio-naive vs floor probe, 150k connections each (target/bench/server.json)"
	@echo "make bench-rollout     8 shards, 16,000 clients rolled within a 400/s budget on the local plane (target/bench/rollout.json)"
	@echo "make bench-scale       1,000 fleets on 500 KWOK nodes, one operator: ramp, quiet window, re-plan, restart, burst (target/bench/scale.json)"
	@echo "make bench-fidelity    one planned shard filled to its cap in its memory cgroup, v1 and socket-accounted (root; target/bench/fidelity.json)"
	@echo "make test-server-scale 40k connections over 3 servers; 100k abusive connections"
	@echo "make fuzz              cargo-fuzz each parser for FUZZ_SECONDS each (default 20; nightly + cargo-fuzz)"

deps:
	@bash tests/cluster/install-deps.sh
	@command -v $(CARGO) >/dev/null || { echo "error: cargo not found: install Rust with rustup" >&2; exit 1; }

build:
	$(CARGO) build --workspace --bins

images: deps
	bash tools/images.sh

cluster-up: deps
	bash tests/cluster/up.sh

# The local plane's real node runs fleets only from images imported from
# $(C10M_CACHE)/images (its containerd pulls nothing), so the local demo
# builds them first; CLUSTER=current uses your cluster's registry instead.
demo: deps build $(if $(filter local,$(CLUSTER)),images)
	@bash tests/demo.sh "$(CLUSTER)"

down:
	@bash tests/demo.sh --stop
	bash tests/cluster/down.sh

test: deps build images
	promtool test rules charts/c10m-operator/rules/c10m.rules.test.yaml
	bash tests/run.sh

test-unit:
	$(CARGO) test --workspace --exclude c10m-e2e

lint: deps
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	python3 tools/module_graph.py operator/src --order $(OPERATOR_LAYERS)
	promtool check rules charts/c10m-operator/rules/c10m.rules.yaml
	test -z "$$(gofmt -l tools/goecho)" || { gofmt -l tools/goecho; echo "error: gofmt -w tools/goecho" >&2; exit 1; }
	cd tools/goecho && GOTOOLCHAIN=local go vet .
	bin=$$(bash tests/cluster/build.sh | tail -n1); \
	  "$$bin/helm" lint --strict charts/c10m-operator && \
	  "$$bin/helm" lint --strict charts/c10m-operator --set watchNamespace=fleets --set crd.manage=false

crd: build
	$(OPERATOR) crd > crds/connectionfleet.yaml
	cp crds/connectionfleet.yaml charts/c10m-operator/crds/connectionfleet.yaml

measure-server:
	$(CARGO) build --release -p c10m-server
	@mkdir -p target/bench
	python3 server-image/bench/idle_memory.py target/release/c10m-server 19000 | tee target/bench/idle-memory.json

# --- c10m-server benchmark, scale test and fuzzing (server-image/README.md) ---
.PHONY: bench-server bench-fidelity test-server-scale fuzz bench-rollout

bench-server:
	$(CARGO) build --release -p c10m-server -p c10m-loadgen --bins --examples
	@mkdir -p target/bench
	python3 server-image/bench/server_bench.py --out target/bench/server.json

# Capacity proof: plans a 15k-18k-connection shard with the real planner and
# fills one real c10m-server to that cap inside the plan's memory cgroup and
# a netns with its sysctls (root, cgroup v1; see the script's docstring).
bench-fidelity:
	$(CARGO) build --release -p c10m-server -p c10m-operator
	@mkdir -p target/bench
	python3 server-image/bench/fidelity.py --out target/bench/fidelity.json

# Issue 22's bigger roll: 8 shards, 16,000 real clients, a 400/s budget, on
# the local plane (started if it is not running; left running: make down).
# At most 15 min, stopped early if MemAvailable falls below 4 GiB; the
# cleanup stops the loadgen, the pod runner and the bench's namespaces.
BENCH_ROLLOUT_CLEANUP = pkill -TERM -f '[c]10m-loadgen --targets-file=.*/rollout-' ; \
  bash tests/cluster/pod-runner.sh stop >/dev/null 2>&1 ; \
  . tests/cluster/env.sh && KUBECONFIG=$$KUBECONFIG_PATH kubectl get ns -o name \
  | grep '^namespace/c10m-e2e-rollout-' | xargs -r env KUBECONFIG=$$KUBECONFIG_PATH kubectl delete --wait=false
bench-rollout: deps build
	bash tests/cluster/up.sh
	@mkdir -p target/bench
	. tests/cluster/env.sh && export C10M_KUBECONFIG=$$KUBECONFIG_PATH \
	  C10M_BIN_DIR=$$(bash tests/cluster/build.sh | tail -n1) \
	  WATCHDOG_CLEANUP="$(BENCH_ROLLOUT_CLEANUP)" && \
	  bash tools/watchdog.sh 900 4096 -- $(CARGO) test -p c10m-e2e --test rollout -- \
	    --ignored bench_rollout --nocapture --test-threads 1
	@cat target/bench/rollout.json

# Issue 23: one operator (the image's release binary), 1,000 fleets on the
# scale plane (tests/cluster/scale.env: 500 KWOK nodes, its own state and
# ports, the test plane untouched), started fresh and purged afterwards.
# The bench stops itself, writing what it measured, past 840 s, when the
# operator's RSS passes 256 MiB or MemAvailable falls below 4 GiB; the
# watchdog stops it at 900 s or 3 GiB in any case. Never part of make test.
BENCH_SCALE_CLEANUP = . tests/cluster/scale.env && bash tests/cluster/down.sh --purge >/dev/null
.PHONY: bench-scale
bench-scale: deps build images
	. tests/cluster/scale.env && bash tests/cluster/down.sh --purge >/dev/null && bash tests/cluster/up.sh
	@mkdir -p target/bench
	. tests/cluster/scale.env && export KUBECONFIG=$$C10M_STATE/kubeconfig \
	  WATCHDOG_CLEANUP="$(BENCH_SCALE_CLEANUP)" && \
	  bash tools/watchdog.sh 900 3072 -- target/debug/c10m-bench-scale \
	    --operator target/x86_64-unknown-linux-musl/release-size/c10m-operator $(BENCH_SCALE_ARGS)

test-server-scale:
	$(CARGO) build --release -p c10m-loadgen
	$(CARGO) test --release -p c10m-server --test scale -- --ignored --nocapture --test-threads 1

# Each target runs FUZZ_SECONDS (e.g. `make fuzz FUZZ_SECONDS=600`); the
# corpus grows in server-image/fuzz/corpus/ (not committed) and libFuzzer's
# closing stats give the execs. Needs `cargo install cargo-fuzz` and nightly.
FUZZ_SECONDS ?= 20
FUZZ_TARGETS ?= ws_frames ws_handshake admin_request
fuzz:
	@command -v cargo-fuzz >/dev/null || { echo "error: cargo-fuzz not found: cargo install cargo-fuzz" >&2; exit 1; }
	cd server-image/fuzz && for t in $(FUZZ_TARGETS); do \
	  echo "== fuzz $$t for $(FUZZ_SECONDS) s"; \
	  $(CARGO) +nightly fuzz run $$t -- -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 || exit 1; \
	  echo "== $$t corpus: $$(ls corpus/$$t | wc -l) inputs"; done
