# The two set-up commands of the README; everything they need is installed by .ci/ scripts.
.PHONY: test lab lab-destroy gpu-check

# every test: pytest, ruff, yamllint, template syntax, ansible-lint, molecule scenarios
test:
	bash .ci/test

# create the lab target (a local systemd container standing in for a Spark) and run site.yml on it
lab:
	bash .ci/lab

# remove the lab target container and its volumes
lab-destroy:
	bash -c 'source .ci/env && ansible-playbook playbooks/lab.yml -e lab_state=absent'

# the checks that need a CUDA GPU: gpu-marked tests and the CUDA-graph check (exits 2 without one)
gpu-check:
	bash .ci/gpu-check
