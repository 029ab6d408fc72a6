# Peer benchmark (`conduit bench peers`): builds the optional peer environments.
#
# Included by the top-level Makefile. Targets:
#   make peers       install cpprb / TorchRL into .venv-demo (torch stays pinned) and build
#                    .venv-reverb, a separate virtualenv for DeepMind Reverb, whose pins
#                    (TensorFlow 2.15, numpy<2, protobuf<5) conflict with Ray's.
#   make bench-peers run the side-by-side benchmark; BENCH_PEERS_ARGS=--quick for a short run.
#
# Reverb runs as a subprocess of the harness (src/conduit/bench/peers/reverb_worker.py) inside
# .venv-reverb; without that venv the harness reports Reverb as skipped, with the reason.

PEERS_VENV        ?= $(DEMO_VENV)
PEERS_PY          ?= $(PEERS_VENV)/bin/python
REVERB_VENV       ?= .venv-reverb
# Python for the Reverb venv: dm-reverb 0.14.0 ships wheels for CPython 3.9-3.11 only.
REVERB_BASE_PY    ?= python3.11
# TensorFlow build that dm-reverb 0.14.0 pins (2.15). The CPU-only wheel is a third of the
# size of the full one and is all the benchmark needs; set REVERB_TF=tensorflow==2.15.1
# for the full build.
REVERB_TF         ?= tensorflow-cpu==2.15.1
TORCH_PIN         ?= torch==2.13.0
BENCH_PEERS_ARGS  ?=

.PHONY: peers peers-main peers-reverb bench-peers

peers: peers-main peers-reverb

# TorchRL is installed with --no-deps so pip can never replace the pinned torch; its own
# runtime dependencies are listed explicitly, and every install that resolves dependencies
# names the torch pin so pip keeps it.
# The default venv is the demo's (conduit with [rl,plots]); it is built first when missing.
peers-main: $(if $(filter $(DEMO_VENV),$(PEERS_VENV)),$(DEMO_VENV)/.installed)
	$(PEERS_PY) -m pip install cpprb '$(TORCH_PIN)'
	$(PEERS_PY) -m pip install --no-deps torchrl==0.14.1 'tensordict>=0.14.3,<0.15' \
		pyvers hoptorch
	$(PEERS_PY) -m pip install importlib-metadata orjson cloudpickle packaging '$(TORCH_PIN)'
	@$(PEERS_PY) -c "import torch, sys; v = torch.__version__.split('+')[0]; \
		sys.exit(0 if v == '$(TORCH_PIN)'.split('==')[1] else \
		f'torch changed to {v}; reinstall $(TORCH_PIN)')"

peers-reverb: $(REVERB_VENV)/.built

$(REVERB_VENV)/.built:
	$(REVERB_BASE_PY) -m venv $(REVERB_VENV)
	$(REVERB_VENV)/bin/python -m pip install --upgrade pip
	$(REVERB_VENV)/bin/python -m pip install dm-reverb==0.14.0 $(REVERB_TF) \
		'numpy<2' 'protobuf<5'
	$(REVERB_VENV)/bin/python -c "import reverb, tensorflow as tf; \
		print('reverb ok, tensorflow', tf.__version__)"
	touch $@

bench-peers:
	$(PEERS_PY) -m conduit.bench.peers $(BENCH_PEERS_ARGS)
