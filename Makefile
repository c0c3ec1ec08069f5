# Unison: `make demo` and `make test` set up .venv on a fresh machine, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NP ?= 2

.PHONY: venv demo test test-fast lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints-dev.txt -e '.[all]'
	touch $(STAMP)

# The model goes to a fresh temporary folder per run. TF_CPP_MIN_LOG_LEVEL=3 (unless set) hides TensorFlow 2.21's
# "failed call to cuInit" on a machine without a GPU (2 still shows it); its "Could not find cuda drivers" lines
# come before TensorFlow reads the variable, and no value hides them.
demo: venv
	dir=$$(mktemp -d "$${TMPDIR:-/tmp}/unison_demo.XXXXXX") && \
	TF_CPP_MIN_LOG_LEVEL=$${TF_CPP_MIN_LOG_LEVEL:-3} $(VENV)/bin/unisonrun -np $(NP) $(PY) examples/keras_fit.py --save "$$dir/keras_fit.keras"

test: venv
	$(PY) -m pytest -q -p no:cacheprovider --durations=40 tests

# The inner-loop tier: no TensorFlow/PyTorch suites under MPI (a few single-process checks of them), about four minutes.
FAST_TESTS := tests/test_layers.py tests/test_elastic_driver.py tests/test_rankwatch.py tests/test_config.py tests/test_files.py tests/test_engine_files.py tests/test_adasum.py tests/test_single_process.py \
	tests/test_pipeline_schedules.py tests/test_launcher.py tests/test_perfmodel.py tests/test_sharded_checkpoint.py tests/test_zero_plan.py tests/test_tensor_parallel_grid.py tests/test_tensor_parallel_render.py tests/test_data_parallel_plan.py tests/test_benchmark_helpers.py tests/test_ps.py tests/test_collectives_mpi.py tests/test_engine_mpi.py

test-fast: venv
	$(PY) -m pytest -q -p no:cacheprovider $(wildcard $(FAST_TESTS))

# Every benchmark, each printing its table and PASS/MISS target lines; JSON and PNGs land in out/.
bench: venv
	mkdir -p out
	$(VENV)/bin/unisonrun -np $(NP) $(PY) benchmarks/collectives.py --json out/collectives.json
	$(VENV)/bin/unisonrun -np $(NP) $(PY) benchmarks/fusion.py --json out/fusion.json
	$(VENV)/bin/unisonrun -np $(NP) $(PY) benchmarks/torch_training.py --json out/torch.json
	$(VENV)/bin/unisonrun -np $(NP) $(PY) benchmarks/keras_training.py --json out/keras.json
	$(VENV)/bin/unisonrun -np $(NP) $(PY) benchmarks/torch_distributed.py --json out/torch_distributed.json
	$(PY) benchmarks/keras_backends.py --json out/keras_backends.json --png out/keras_backends.png
	$(PY) benchmarks/pipeline.py --json out/pipeline.json --png-dir out/pipeline
	$(PY) benchmarks/hosts.py --json out/hosts.json
	$(PY) benchmarks/embeddings.py --json out/embeddings.json --png out/embeddings.png
	$(PY) benchmarks/zero.py --json out/zero.json --png out/zero_bytes.png
	$(PY) benchmarks/elastic.py --json out/elastic.json --png out/elastic_timeline.png
	$(PY) benchmarks/tensor_parallel.py --json out/tensor_parallel.json --png out/tensor_parallel.png --grid-png out/tp_grid.png

lint: venv
	$(VENV)/bin/ruff check unison tests benchmarks examples
	$(VENV)/bin/mypy unison/common unison/collectives

clean:
	rm -rf $(VENV) build *.egg-info
