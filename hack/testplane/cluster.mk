# Make targets for a long-lived local test plane (included from the top-level Makefile).
# State, logs, certificates and the admin kubeconfig live in $(CLUSTER_DIR) (git-ignored).
CLUSTER_DIR ?= .cluster
CLUSTER_NODES ?= 3

cluster-up:  ## start the real control plane (etcd, apiserver, controllers, kwok GPU nodes) in .cluster
	@bash hack/testplane/build.sh >/dev/null
	@V=$$(bash hack/venv.sh) && $$V/bin/python hack/testplane/plane.py up \
	  --dir $(CLUSTER_DIR) --nodes $(CLUSTER_NODES)
	@echo 'use it with: eval "$$(make -s cluster-env CLUSTER_DIR=$(CLUSTER_DIR))"'

cluster-env:  ## print the KUBECONFIG/PATH exports for the running test plane
	@V=$$(bash hack/venv.sh) && $$V/bin/python hack/testplane/plane.py env --dir $(CLUSTER_DIR)

cluster-down:  ## stop the test plane started by cluster-up
	@V=$$(bash hack/venv.sh) && $$V/bin/python hack/testplane/plane.py down --dir $(CLUSTER_DIR)

.PHONY: cluster-up cluster-env cluster-down
