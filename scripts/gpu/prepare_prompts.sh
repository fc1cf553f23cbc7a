#!/usr/bin/env bash
# Prompt set of REBEL's UltraFeedback recipe, reduced to its prompt columns. Run once, before generate.sh/iterate.sh.
#
#   conda env: rlhf-train (envs/train.yml; rlhf-vllm works too, it only needs `datasets`). Needs Hub access,
#              unless SOURCE is a local file or directory (any dataset reference `rlhf generate --prompts` reads).
#   reads:     allenai/ultrafeedback_binarized_cleaned_train, split train (the default prompts of REBEL's
#              src/ultrafeedback_largebatch/generate.py:23,51, github.com/ZhaolinGao/REBEL at commit 4ad7c11)
#   writes:    runs/prompts/ultrafeedback (datasets.save_to_disk; columns prompt_id, prompt; same rows and order)
#
# Why not pass the Hub id straight to `rlhf generate`: the UltraFeedback binarized sets also carry `chosen`,
# `rejected` and `messages` conversations; every stage carries extra columns through (filter keeps them as
# source_chosen/source_rejected), which only makes each iteration's data bigger. Keeping prompt_id/prompt also pins
# one snapshot of the prompts for all iterations.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."   # repo root: relative paths below resolve from here

SOURCE=${SOURCE:-allenai/ultrafeedback_binarized_cleaned_train}   # REBEL: generate.py --prompts default; or a local
                                                                    # .json/.jsonl/.parquet file or dataset directory
SPLIT=${SPLIT:-train}                                               # Hub only, as REVISION
REVISION=${REVISION:-}                                              # optional Hub revision (commit/tag) to pin
PROMPTS=${PROMPTS:-runs/prompts/ultrafeedback}                     # output directory

if [ -e "$PROMPTS" ]; then
  echo "[prepare_prompts] $PROMPTS exists; nothing to do (remove it to rebuild)"
  exit 0
fi

python - "$SOURCE" "$SPLIT" "$REVISION" "$PROMPTS" <<'PY'
import os, sys
from datasets import load_dataset

source, split, revision, out = sys.argv[1:]
if os.path.exists(source):  # a local file or directory, read as every stage reads a dataset reference
    from rlhf_pipeline.datasets_io import load_dataset_ref, parse_ref
    ds = load_dataset_ref(parse_ref(source))
else:
    ds = load_dataset(source, split=split, revision=revision or None, token=os.environ.get("HF_TOKEN"))
keep = [c for c in ("prompt_id", "prompt") if c in ds.column_names]
if "prompt" not in keep:
    sys.exit(f"{source}:{split} has no 'prompt' column (columns: {ds.column_names})")
ds = ds.select_columns(keep)
tmp = out + ".tmp"
ds.save_to_disk(tmp)
os.replace(tmp, out)
print(f"[prepare_prompts] {ds.num_rows} prompts ({', '.join(keep)}) from {source}:{split} -> {out}")
PY
