"""The dataset of the bundled lm-eval task ``rlhf_arith`` (rlhf_arith.yaml's ``custom_dataset``): the jsonl beside
this file, read by path so that the task loads offline from any working directory."""

from pathlib import Path


def load(**_metadata):
    # lm-eval passes the task's metadata (and the model's arguments) as keywords; none of them matter here.
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(Path(__file__).with_name("rlhf_arith.jsonl"))})
