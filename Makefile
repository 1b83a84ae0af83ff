# Two entry points for a fresh machine: `make train` (main job) and `make test` (test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bev-installed
DATA ?= data/synthetic
RUN ?= outputs/synthetic_cpu
# Key frames per synthetic scene for `make train` (10 scenes: 8 train, 2 val): longer drives see more
# of the road network (docs/benchmarks.md).
SYNTHETIC_SAMPLES ?= 192
# The embedded default reads 352x128 crops of the LSS resize (~0.22 of 1600x900): a 400x225 ray-cast
# (render scale 4) is enough and writes the set in about half the time of the 800x450 default.
SYNTHETIC_RENDER_SCALE ?= 4
# The JPEGs at that render resolution (400x225, with its intrinsics) rather than upscaled to nuScenes' 1600x900:
# the same scene and inputs (resize_lim scales with the image size), a quarter less CPU to write, a third of the disk.
SYNTHETIC_IMAGE_SIZE ?= render
SYNTHETIC_SET = --samples-per-scene $(SYNTHETIC_SAMPLES) --render-scale $(SYNTHETIC_RENDER_SCALE)
SYNTHETIC_ARGS = $(SYNTHETIC_SET) --image-size $(SYNTHETIC_IMAGE_SIZE)
TORCH_PINS := torch==2.14.1 torchvision==0.29.1

# Compile the CUDA kernels too when nvcc is present (no GPU needed to compile).
NVCC := $(shell command -v nvcc 2>/dev/null)
ifneq ($(NVCC),)
CUDA_HOME ?= /usr/local/cuda
TORCH_CUDA_ARCH_LIST ?= 8.0;9.0
BUILD_ENV = CUDA_HOME=$(CUDA_HOME) TORCH_CUDA_ARCH_LIST="$(TORCH_CUDA_ARCH_LIST)" \
	CPATH="$$($(PY) -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13", "include"))' 2>/dev/null):$$CPATH"
endif

.PHONY: venv build train train-temporal train-det train-occ train-lidar train-fusion test test-unit test-all bench gpu-check gpu-wheels clean

venv: $(STAMP)

# Files under a folder matching patterns, recursively: the extension's sources live in
# csrc/ (schemas), csrc/cpu/ and csrc/cuda/ (kernels).
rwildcard = $(foreach d,$(wildcard $(1:=/*)),$(call rwildcard,$d,$2) $(filter $(subst *,%,$2),$d))
CSRC := $(call rwildcard,bev/ops/csrc,*.cpp *.cu *.h *.cuh)

# torch's x86_64 wheel is a CUDA build: a new venv takes about 6 GiB.
$(STAMP): pyproject.toml setup.py $(CSRC)
	@free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if ! test -x $(PY) && [ "$$free" -lt 7 ]; then \
		echo "make: warning: $$free GiB free here; a new venv (torch + the project) needs about 7 GiB: free some disk space if the install fails with 'No space left on device'" >&2; fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=64" wheel ninja
	$(PY) -m pip install -q $(TORCH_PINS)
	$(BUILD_ENV) MAX_JOBS=2 $(PY) -m pip install -q --no-build-isolation -e ".[test]"
	touch $(STAMP)

build: venv

# `make train` ends within TRAIN_MINUTES in all on a slow machine too: bev-train must end by a deadline,
# TRAIN_MINUTES after make started (installing the venv, writing the data and bev-train's start-up all
# count) less EVAL_RESERVE_S for the evaluation's pictures and the plots. Before it, bev.callbacks.TimeBudget
# keeps free what the evaluation takes as measured in this run: bev-train's start-up (bev-eval starts up
# alike: imports, indexing the split) and EVAL_RESERVE_VALIDATIONS validations; it shortens the run, with
# the LR schedule ending there, only if it must. Training gets at least MIN_TRAIN_S from its first step,
# past the deadline if need be, and make says so before training starts (bev/make_train.py);
# its last lines say how much of the schedule fitted when that is under a quarter, and what to do.
TRAIN_MINUTES ?= 20
EVAL_RESERVE_S ?= 45
EVAL_RESERVE_VALIDATIONS ?= 1
MIN_TRAIN_S ?= 120
MAKE_START := $(shell date +%s)

# A second `make train` resumes the run from its last.ckpt: a run the time limit shortened trains on
# towards its planned steps, a finished one is just evaluated again.
train: venv
	@set -e; \
	test -f $(DATA)/v1.0-mini/scene.json || $(VENV)/bin/bev-make-synthetic --out $(DATA) $(SYNTHETIC_ARGS) --no-occupancy; \
	deadline=$$($(PY) -m bev.make_train deadline --make-start $(MAKE_START) --minutes $(TRAIN_MINUTES) \
		--eval-reserve-s $(EVAL_RESERVE_S) --min-train-s $(MIN_TRAIN_S)); \
	$(VENV)/bin/bev-train experiment=synthetic_cpu data.dataroot=$(DATA) hydra.run.dir=$(RUN) \
		callbacks.time_budget.budget=null callbacks.time_budget.deadline=$$deadline \
		callbacks.time_budget.reserve_validations=$(EVAL_RESERVE_VALIDATIONS) \
		callbacks.time_budget.min_train_s=$(MIN_TRAIN_S) callbacks.time_budget.reserve_startup=true \
		$(if $(wildcard $(RUN)/checkpoints/last.ckpt),ckpt_path=$(RUN)/checkpoints/last.ckpt)
	$(VENV)/bin/bev-eval ckpt_path=$(RUN)/checkpoints data.dataroot=$(DATA) hydra.run.dir=$(RUN)/eval overwrite=true
	$(PY) -m bev.make_train plot $(RUN) --out $(RUN)/learning_curve.png
	@echo "Checkpoints: $(RUN)/checkpoints (best by val/iou + last.ckpt)  Metrics: $(RUN)/eval/metrics.json  Pictures: $(RUN)/eval/sample_*.png, $(RUN)/pngs/, $(RUN)/learning_curve.png"
	@$(PY) -m bev.make_train report $(RUN) --data $(DATA) --make-start $(MAKE_START) --minutes $(TRAIN_MINUTES)

# The temporal model (experiment=synthetic_temporal_cpu, ~15 min of training on 2 cores) on the same data,
# started from `make train`'s checkpoint when there is one (its best, else last.ckpt: the two-stage
# recipe), else from scratch; a second run resumes from its own last.ckpt.
TEMPORAL_RUN ?= outputs/synthetic_temporal_cpu
train-temporal: venv
	@set -e; \
	test -f $(DATA)/v1.0-mini/scene.json || $(VENV)/bin/bev-make-synthetic --out $(DATA) $(SYNTHETIC_ARGS) --no-occupancy; \
	$(VENV)/bin/bev-train experiment=synthetic_temporal_cpu data.dataroot=$(DATA) hydra.run.dir=$(TEMPORAL_RUN) \
		$(if $(wildcard $(RUN)/checkpoints/*.ckpt),model.init_from=$(RUN)/checkpoints) \
		$(if $(wildcard $(TEMPORAL_RUN)/checkpoints/last.ckpt),ckpt_path=$(TEMPORAL_RUN)/checkpoints/last.ckpt)
	$(VENV)/bin/bev-eval ckpt_path=$(TEMPORAL_RUN)/checkpoints data.dataroot=$(DATA) hydra.run.dir=$(TEMPORAL_RUN)/eval overwrite=true
	@echo "Checkpoints: $(TEMPORAL_RUN)/checkpoints  Metrics: $(TEMPORAL_RUN)/eval/metrics.json"

# 3D detection (experiment=synthetic_det_cpu: boxes of the 10 nuScenes classes beside segmentation, scored by
# the devkit's DetectionEval) on the same data, started from `make train`'s checkpoint when there is one (the
# two-stage recipe, better at equal steps: docs/detection.md), else from scratch; a second run resumes from
# its own last.ckpt.
DET_RUN ?= outputs/synthetic_det_cpu
train-det: venv
	@set -e; \
	test -f $(DATA)/v1.0-mini/scene.json || $(VENV)/bin/bev-make-synthetic --out $(DATA) $(SYNTHETIC_ARGS) --no-occupancy; \
	$(VENV)/bin/bev-train experiment=synthetic_det_cpu data.dataroot=$(DATA) hydra.run.dir=$(DET_RUN) \
		$(if $(wildcard $(RUN)/checkpoints/*.ckpt),model.init_from=$(RUN)/checkpoints) \
		$(if $(wildcard $(DET_RUN)/checkpoints/last.ckpt),ckpt_path=$(DET_RUN)/checkpoints/last.ckpt)
	$(VENV)/bin/bev-eval ckpt_path=$(DET_RUN)/checkpoints data.dataroot=$(DATA) hydra.run.dir=$(DET_RUN)/eval overwrite=true
	@echo "Checkpoints: $(DET_RUN)/checkpoints  Metrics: $(DET_RUN)/eval/metrics.json  Results: $(DET_RUN)/eval/results_nusc.json"

# 3D semantic occupancy (experiment=synthetic_occ_cpu: Occ3D-format labels, Occ3D's mIoU, ~20 min of training on
# 2 cores) on the same data; to a set written without occupancy labels (no gts/: `make train` leaves them out, a
# quarter of its data step) they are added (--occupancy-only, in the image size the set records), nothing else
# rewritten. Started from `make train`'s checkpoint when there is one (its camera and BEV encoders: the two-stage
# recipe, better at equal time: docs/occupancy.md), else from scratch; a second run resumes from its own last.ckpt.
OCC_RUN ?= outputs/synthetic_occ_cpu
train-occ: venv
	@set -e; \
	if ! test -f $(DATA)/v1.0-mini/scene.json; then \
		$(VENV)/bin/bev-make-synthetic --out $(DATA) $(SYNTHETIC_ARGS); \
	elif ! test -d $(DATA)/gts; then \
		echo "$(DATA) has no occupancy labels (gts/): adding them"; \
		$(VENV)/bin/bev-make-synthetic --out $(DATA) $(SYNTHETIC_SET) --occupancy-only; \
	fi; \
	$(VENV)/bin/bev-train experiment=synthetic_occ_cpu data.dataroot=$(DATA) hydra.run.dir=$(OCC_RUN) \
		$(if $(wildcard $(RUN)/checkpoints/*.ckpt),model.init_from=$(RUN)/checkpoints) \
		$(if $(wildcard $(OCC_RUN)/checkpoints/last.ckpt),ckpt_path=$(OCC_RUN)/checkpoints/last.ckpt)
	$(VENV)/bin/bev-eval ckpt_path=$(OCC_RUN)/checkpoints data.dataroot=$(DATA) hydra.run.dir=$(OCC_RUN)/eval overwrite=true
	@echo "Checkpoints: $(OCC_RUN)/checkpoints  Metrics: $(OCC_RUN)/eval/metrics.json  Predictions: $(OCC_RUN)/eval/predictions/"

# LiDAR-only (experiment=synthetic_lidar_cpu: make train-det's tasks on the key frames' ray-cast points, no cameras)
# on the same data, from scratch; a second run resumes from its own last.ckpt.
LIDAR_RUN ?= outputs/synthetic_lidar_cpu
train-lidar: venv
	@set -e; \
	test -f $(DATA)/v1.0-mini/scene.json || $(VENV)/bin/bev-make-synthetic --out $(DATA) $(SYNTHETIC_ARGS) --no-occupancy; \
	$(VENV)/bin/bev-train experiment=synthetic_lidar_cpu data.dataroot=$(DATA) hydra.run.dir=$(LIDAR_RUN) \
		$(if $(wildcard $(LIDAR_RUN)/checkpoints/last.ckpt),ckpt_path=$(LIDAR_RUN)/checkpoints/last.ckpt)
	$(VENV)/bin/bev-eval ckpt_path=$(LIDAR_RUN)/checkpoints data.dataroot=$(DATA) hydra.run.dir=$(LIDAR_RUN)/eval overwrite=true

# Camera + LiDAR (experiment=synthetic_fusion_cpu: make train-det's tasks and schedule, the pillar LiDAR branch,
# BEVFusion's ConvFuser) on the same data, started as BEVFusion starts its fused stage: the camera branch from
# `make train`'s checkpoint, the LiDAR branch, decoder and heads from `make train-lidar`'s (each when there is one;
# docs/lidar.md#figures); a second run resumes from its own last.ckpt.
FUSION_RUN ?= outputs/synthetic_fusion_cpu
comma := ,
FUSION_INIT = $(strip $(if $(wildcard $(RUN)/checkpoints/*.ckpt),$(RUN)/checkpoints) \
	$(if $(wildcard $(LIDAR_RUN)/checkpoints/*.ckpt),$(LIDAR_RUN)/checkpoints))
train-fusion: venv
	@set -e; \
	test -f $(DATA)/v1.0-mini/scene.json || $(VENV)/bin/bev-make-synthetic --out $(DATA) $(SYNTHETIC_ARGS) --no-occupancy; \
	$(VENV)/bin/bev-train experiment=synthetic_fusion_cpu data.dataroot=$(DATA) hydra.run.dir=$(FUSION_RUN) \
		$(if $(FUSION_INIT),'model.init_from=[$(subst $() ,$(comma),$(FUSION_INIT))]') \
		$(if $(wildcard $(FUSION_RUN)/checkpoints/last.ckpt),ckpt_path=$(FUSION_RUN)/checkpoints/last.ckpt)
	$(VENV)/bin/bev-eval ckpt_path=$(FUSION_RUN)/checkpoints data.dataroot=$(DATA) hydra.run.dir=$(FUSION_RUN)/eval overwrite=true
	@echo "Checkpoints: $(FUSION_RUN)/checkpoints  Metrics: $(FUSION_RUN)/eval/metrics.json  Results: $(FUSION_RUN)/eval/results_nusc.json"

# One pytest worker per core (pytest-xdist; at most 4: each holds its own torch). worksteal: the tests are
# split evenly and a worker that runs out takes half of another's queue, so no core idles at the end.
PYTEST := $(PY) -m pytest -q -n auto --maxprocesses 4 --dist worksteal

test: venv
	$(PYTEST) -m "not slow"

# The unit tests alone: no entry point run end to end (tests/conftest.py marks those e2e), nothing slow.
test-unit: venv
	$(PYTEST) -m "not slow and not e2e"

test-all: venv
	$(PYTEST)

bench: venv
	$(PY) scripts/bench_pool.py

# On a GPU machine: build for the device, CUDA + emulated tests, GPU benchmark, a short GPU
# training run; writes benchmarks/results/gpu_<device>.json (see scripts/gpu_check.sh).
gpu-check:
	PYTHON=$(PYTHON) bash scripts/gpu_check.sh $(GPU_CHECK_ARGS)

# For a GPU machine with no package index: download here the wheels gpu-check's training stage
# needs beyond a CUDA torch image (seen missing on the lent H200 image), into .whl/ (git-ignored),
# which gpu_check.sh installs privately. GPU_PYTHON is the GPU machine's Python version.
GPU_PYTHON ?= 3.12
GPU_WHEELS := hydra-core==1.3.8 omegaconf==2.3.1 nuscenes-devkit==1.2.0 pyquaternion==0.9.9 \
	shapely==2.0.7 descartes==1.1.0 cachetools==5.5.2
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
	$(PYTHON) -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w .whl  # published as a source archive only

clean:
	rm -rf build *.egg-info bev/ops/_C*.so
