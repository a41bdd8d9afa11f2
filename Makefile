# Two entry points for a fresh Debian machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1

.PHONY: demo test test-fast lint sysdeps venv bench clean

sysdeps:
	bash scripts/install-system-deps.sh

# CPU builds of torch and TensorFlow are installed first so that nothing pulls a CUDA build from
# the registry (the package's `tensorflow` extra names the full `tensorflow`).
$(STAMP): setup.cfg pyproject.toml setup.py $(wildcard src_native/*.c src_native/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0" "tensorflow-cpu>=2.16"
	$(PY) -m pip install -q -e ".[mpi,torch,plot,dev]"
	touch $@

venv: sysdeps $(STAMP)

demo: venv
	$(VENV)/bin/hpc-horovod run -np 2 $(PY) examples/pytorch_digits.py --epochs 5 --checkpoint-dir $(VENV)/demo-checkpoints --no-resume

test: venv
	$(PY) -m ruff check .
	$(PY) -m pytest -q --timeout=600 --durations=30 tests

lint: venv
	$(PY) -m ruff check .

# Results in benchmarks/results/ (committed), the report in benchmarks/RESULTS.md. BEFORE=DIR:
# the training benchmark also runs the checkout in DIR (its extension built in place), the
# reference of its speed-ups. HOROVOD=DIR: horovod.torch imported from DIR (Horovod 0.28.1 built
# there) runs beside it. scaling.py starts its own jobs of 2 .. 64 ranks on this host (mpirun).
bench: venv
	$(VENV)/bin/hpc-horovod run -np 2 $(PY) benchmarks/allreduce.py
	$(if $(HOROVOD),PYTHONPATH=$(HOROVOD)) $(PY) benchmarks/training.py --processes 2 \
		$(if $(BEFORE),--compare-with $(BEFORE))
	$(PY) benchmarks/elastic_commit.py
	$(PY) benchmarks/scaling.py
	$(PY) benchmarks/report.py

clean:
	rm -rf $(VENV) build *.egg-info
