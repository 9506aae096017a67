#!/usr/bin/env bash
# README's main job: install (if needed), prepare the bundled stdlib corpus (if needed), and train the
# CPU preset — a tiny Llama at TP=2 x PP=2 on 4 processes. Extra arguments go to pretrain.py
# (e.g. --set train.steps=20). Output: runs/tiny_llama_cpu/{config.json,metrics.jsonl,tensorboard/,checkpoints/}.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh test
.venv/bin/python tools/prepare_corpus.py
export OMP_NUM_THREADS=1  # 4 ranks share the cores
exec .venv/bin/torchrun --standalone --nproc-per-node 4 tools/pretrain.py --config tiny_llama_cpu \
  --run-dir runs/tiny_llama_cpu "$@"
