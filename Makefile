# The two set-up commands of the README; everything they need is installed by .ci/ scripts.
.PHONY: test test-stress lab lab-destroy gpu-check gpu-bundle

# every test: pytest, ruff, mypy, yamllint, template syntax, ansible-lint, molecule scenarios
test:
	bash .ci/test

# the pytest phase of `make test` with stress-ng loading the CPUs, the disk and memory beside it
test-stress:
	bash .ci/test-stress

# create the lab target (a local systemd container standing in for a Spark) and run site.yml on it
lab:
	bash .ci/lab

# remove the lab target container and its volumes
lab-destroy:
	bash -c 'source .ci/env && ansible-playbook playbooks/lab.yml -e lab_state=absent'

# the checks that need a CUDA GPU (exits 2 at once without one); PYTHON=/path/to/python3 names
# a Python with CUDA torch (default python3; no venv is built)
gpu-check:
	PYTHON="$(PYTHON)" bash .ci/gpu-check

# the GPU check for a machine without network: one archive, its path the last line printed;
# TARGET names the machine (a file of gpu/targets/, or ARCH-pyX.Y; default h200-offline)
gpu-bundle:
	TARGET="$(TARGET)" bash .ci/gpu-bundle
