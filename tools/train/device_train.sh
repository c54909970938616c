#!/usr/bin/env bash
# Train the small model on the H200 (the device tool runs this in the repository root, with the corpus and the
# transformers wheel carried: carry [".train", ".whl"]):
#   python3 -m tools.train.corpus --deb /var/cache/apt/archives/python3.11-doc_*.deb --out .train/corpus
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl transformers==5.24.0
#   device: SECONDS_BUDGET=380 bash tools/train/device_train.sh      (writes $OUT/model, $OUT/train.log)
# then here: python3 -m tools.train.export --run <files_at>/model --corpus .train/corpus \
#       --out loader/weights/qwen3.5-tiny-trained
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())'
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
python3 -m tools.train.train --corpus .train/corpus --out "$OUT/model" --seconds "${SECONDS_BUDGET:-380}" 2>&1 \
    | tee "$OUT/train.log"
