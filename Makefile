# The few verbs people type. Everything heavy is cached outside the clone (see README).
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV = $(shell bash hack/venv.sh)
PYTEST_ARGS ?=
# This checkout's sources come first, in every recipe and every process the tests start (the
# clone's .venv from hack/venv.sh imports them anyway; this also covers any other Python).
export PYTHONPATH := $(CURDIR)/workers:$(CURDIR)/operator$(if $(PYTHONPATH),:$(PYTHONPATH),)

help:  ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

deps:  ## install system packages, the Python venv and the Go-built test plane (all cached)
	bash hack/system-deps.sh
	bash hack/venv.sh >/dev/null
	bash hack/testplane/build.sh >/dev/null
	bash hack/testplane/keda-crd.sh >/dev/null
	bash hack/testplane/monitoring-crds.sh >/dev/null

demo:  ## local mode: build a tiny model, serve it disaggregated, stream a few requests, stop
	@V=$$(bash hack/venv.sh) && $$V/bin/splitserve up --demo

up:  ## local mode, interactive: router + 1 prefill + 1 decode on the embedded tiny model
	@V=$$(bash hack/venv.sh) && $$V/bin/splitserve up

test: deps  ## every test, including the real control plane, Prometheus and gRPC processes
	@V=$$(bash hack/venv.sh) && PATH=$$V/bin:$$PATH bash hack/checks.sh && \
	  PATH=$$V/bin:$$PATH $$V/bin/pytest $(PYTEST_ARGS)

test-fast:  ## tests that need no control plane or Prometheus server (promtool: `make deps`)
	@V=$$(bash hack/venv.sh) && $$V/bin/pytest -m "not cluster" $(PYTEST_ARGS)

lint:  ## ruff + mypy on the operator and the pure cores
	@V=$$(bash hack/venv.sh) && $$V/bin/ruff check . && $$V/bin/ruff format --check . && \
	  $$V/bin/mypy

protos:  ## regenerate gRPC stubs from protos/
	@V=$$(bash hack/venv.sh) && PATH=$$V/bin:$$PATH bash hack/gen-protos.sh

crds:  ## copy the CRD source of truth into the chart and manifests/
	bash hack/sync-crd.sh

chart-test:  ## helm lint --strict + chart rendering tests
	@V=$$(bash hack/venv.sh) && B=$$(bash hack/testplane/build.sh) && \
	  $$B/helm lint --strict charts/splitserve && $$V/bin/pytest tests/operator -k chart

bench:  ## benchmarks: print tables, write bench/results/*.json
	@V=$$(bash hack/venv.sh) && for b in engine kv_transfer kv_stages serve operator testplane autoscaler prefix_routing structured speculative priority; do \
	  [ -f bench/$$b.py ] && $$V/bin/python bench/$$b.py; done

-include hack/testplane/cluster.mk

.PHONY: help deps demo up test test-fast lint protos crds chart-test bench
