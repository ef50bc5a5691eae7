#!/usr/bin/env bash
# The README's first command: train torchtitan's llama3 debug model with Dion3 (f=0.25, NorMuon)
# on the offline corpus. On a fresh machine it creates ./.venv, builds the corpus and tokenizer
# (data/dion3_docs_small, ~10 s), then launches 2 CPU ranks (gloo) -- or one rank per GPU when
# GPUs are present -- with FSDP2. Extra arguments go to the trainer, e.g.
#   scripts/train_debug.sh --training.steps 100 --optimizer.fraction 0.5
# CONFIG=configs/llama3_debug_muon.toml scripts/train_debug.sh runs another config.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup_env.sh

CONFIG=${CONFIG:-configs/llama3_debug_dion3.toml}
# A bad config stops here, as one line naming the key (exit code 2): after a worker's failure
# torchrun would print its own failure report below the reason.
.venv/bin/python -m dion3_titan.titan02.check_config --job.config_file "$CONFIG" "$@"

.venv/bin/python -m dion3_titan.data.build --size small   # returns at once when already built

NGPU=$(.venv/bin/python -c "import torch; print(torch.accelerator.device_count() if torch.accelerator.is_available() else 0)")
NPROC=$(( NGPU > 0 ? NGPU : 2 ))
# The console shows rank 0; every rank's full output is also kept under outputs/torchrun_logs/.
exec .venv/bin/torchrun --nproc_per_node "$NPROC" --local-ranks-filter 0 --log-dir outputs/torchrun_logs --tee 3 \
  -m dion3_titan.train --job.config_file "$CONFIG" "$@"
