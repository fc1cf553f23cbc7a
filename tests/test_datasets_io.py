"""Dataset references, atomic outputs, manifests and the reuse rules."""

import json
from pathlib import Path
from typing import Optional
from dataclasses import dataclass

import pytest
from datasets import Dataset, DatasetDict, load_from_disk

from rlhf_pipeline.config import OutputOptions, option
from rlhf_pipeline.datasets_io import (
    MANIFEST,
    HubTarget,
    StageOutput,
    atomic_directory,
    clean_stale,
    fingerprint,
    hub_commit,
    hub_manifest,
    input_record,
    load_dataset_dict,
    load_dataset_ref,
    parse_ref,
    pull_output,
    read_manifest,
    same_inputs,
)
from rlhf_pipeline.errors import PipelineError

import fake_hub
from conftest import write_jsonl


@dataclass(kw_only=True)
class Cfg(OutputOptions):
    value: int = option(1, help="a value")
    model: Optional[str] = option(None, help="a model path")


def test_parse_ref_kinds(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    assert parse_ref(f).kind == "file"
    assert parse_ref(str(tmp_path)).kind == "dir"
    split = parse_ref(f"{tmp_path}:train")
    assert (split.kind, split.location, split.split) == ("dir", str(tmp_path), "train")
    hub = parse_ref("HuggingFaceH4/ultrafeedback_binarized:train_prefs@abc123")
    assert (hub.kind, hub.location, hub.split, hub.revision) == (
        "hub", "HuggingFaceH4/ultrafeedback_binarized", "train_prefs", "abc123"
    )


def test_parse_ref_errors(tmp_path):
    with pytest.raises(PipelineError, match="no such file"):
        parse_ref(str(tmp_path / "missing.jsonl"))
    with pytest.raises(PipelineError, match="no such file"):
        parse_ref("./relative/missing")
    bad = tmp_path / "p.csv"
    bad.write_text("a\n1\n")
    with pytest.raises(PipelineError, match="unsupported file type '.csv'"):
        parse_ref(str(bad))


def test_load_file_and_directory_splits(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    assert load_dataset_ref(parse_ref(f))["prompt"] == ["a", "b"]
    d = tmp_path / "dd"
    DatasetDict({"train": Dataset.from_dict({"x": [1, 2]}), "test": Dataset.from_dict({"x": [3]})}).save_to_disk(d)
    with pytest.raises(PipelineError, match="has splits train, test; choose one"):
        load_dataset_ref(parse_ref(str(d)))
    assert load_dataset_ref(parse_ref(f"{d}:test"))["x"] == [3]
    with pytest.raises(PipelineError, match="no split 'valid'"):
        load_dataset_ref(parse_ref(f"{d}:valid"))
    assert set(load_dataset_dict(parse_ref(str(d)), required=("train", "test"))) == {"train", "test"}
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(PipelineError, match="not a dataset directory"):
        load_dataset_ref(parse_ref(str(plain)))


def test_fingerprint_follows_file_content(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}])
    before = fingerprint(parse_ref(f))
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "b"}])
    assert fingerprint(parse_ref(f)) != before


def test_two_splits_of_one_source_are_different_data(tmp_path):
    """An output made from one split is not taken for the same run on another (the option that names the input is
    compared by the data's fingerprint, not by how it is spelled)."""
    d = tmp_path / "dd"
    DatasetDict({"train": Dataset.from_dict({"x": [1, 2]}), "test": Dataset.from_dict({"x": [3]})}).save_to_disk(d)
    _run(tmp_path, inputs=[parse_ref(f"{d}:train")])
    assert _run(tmp_path, inputs=[parse_ref(f"{d}:train")]) is None  # the same run
    with pytest.raises(PipelineError, match="the input data changed"):
        _run(tmp_path, inputs=[parse_ref(f"{d}:test")])
    # a manifest from before the splits were recorded is not held to them
    recorded = json.loads((tmp_path / "out" / MANIFEST).read_text())
    del recorded["inputs"][0]["split"]
    (tmp_path / "out" / MANIFEST).write_text(json.dumps(recorded))
    assert _run(tmp_path, inputs=[parse_ref(f"{d}:train")]) is None


def test_a_file_is_its_one_split():
    """FILE:train names the file's one split (as datasets names it); another split of a file is refused, not
    dropped without a word."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        f = write_jsonl(Path(d) / "p.jsonl", [{"prompt": "hi"}])
        assert parse_ref(f"{f}:train") == parse_ref(f)
        with pytest.raises(PipelineError, match="holds one split"):
            parse_ref(f"{f}:test")


def test_a_hub_revision_may_hold_slashes():
    ref = parse_ref("org/data:train@refs/pr/1")
    assert (ref.kind, ref.location, ref.split, ref.revision) == ("hub", "org/data", "train", "refs/pr/1")


def _run(tmp_path, value=1, overwrite=False, inputs=()):
    out = StageOutput("unit", Cfg(output=str(tmp_path / "out"), value=value, overwrite=overwrite), list(inputs))
    if out.done():
        return None
    out.save(Dataset.from_dict({"x": [value]}), rows_in=1, dropped={"too_long": 2})
    return json.loads((tmp_path / "out" / MANIFEST).read_text())


def test_manifest_is_written_last_and_complete(tmp_path):
    manifest = _run(tmp_path)
    assert manifest["stage"] == "unit" and manifest["rows_in"] == 1 and manifest["rows_out"] == 1
    assert manifest["dropped"] == {"too_long": 2} and manifest["config"]["value"] == 1
    assert manifest["wall_time_s"] >= 0 and manifest["version"]
    assert load_from_disk(str(tmp_path / "out"))["x"] == [1]


def test_identical_rerun_is_skipped(tmp_path, capsys):
    first = _run(tmp_path)
    assert _run(tmp_path) is None  # nothing recomputed
    assert "nothing to do" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["output_id"] == first["output_id"]


def test_changed_input_or_config_refuses_without_overwrite(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}])
    _run(tmp_path, inputs=[parse_ref(f)])
    with pytest.raises(PipelineError, match=r"value 1 -> 2.*--overwrite"):
        _run(tmp_path, value=2, inputs=[parse_ref(f)])
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "changed"}])
    with pytest.raises(PipelineError, match="the input data changed"):
        _run(tmp_path, inputs=[parse_ref(f)])
    manifest = _run(tmp_path, value=2, overwrite=True, inputs=[parse_ref(f)])
    assert manifest["config"]["value"] == 2
    assert load_from_disk(str(tmp_path / "out"))["x"] == [2]


def test_a_run_whose_model_was_made_again_is_redone(tmp_path):
    """A stage output that an option names (the policy generate samples from, say) is recorded by its output_id: a
    policy retrained into the same directory makes what was sampled from it stale, though every option string is the
    same. Model directories no stage wrote are not recorded; an older manifest without the record still matches."""
    model = tmp_path / "policy"
    model.mkdir()
    (model / MANIFEST).write_text(json.dumps({"stage": "train", "output_id": "first"}))
    config = Cfg(output=str(tmp_path / "out"), model=str(model))
    out = StageOutput("unit", config, [])
    assert out.used_outputs == {"model": "first"}
    out.save(Dataset.from_dict({"x": [1]}), rows_in=1)
    assert StageOutput("unit", config, []).done()
    (model / MANIFEST).write_text(json.dumps({"stage": "train", "output_id": "second"}))
    with pytest.raises(PipelineError, match="model was made again since"):
        StageOutput("unit", config, []).done()
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    del manifest["used_outputs"]
    (tmp_path / "out" / MANIFEST).write_text(json.dumps(manifest))
    assert StageOutput("unit", config, []).done()
    (model / MANIFEST).unlink()  # a model no stage wrote
    assert StageOutput("unit", config, []).used_outputs == {}


def test_directory_without_manifest_is_refused_and_never_deleted(tmp_path):
    """Files no stage wrote (no manifest, no run record) stay, --overwrite or not; an empty directory is used."""
    (tmp_path / "out").mkdir()
    assert _run(tmp_path)["rows_out"] == 1  # empty: nothing to keep
    (tmp_path / "out" / MANIFEST).unlink()
    for overwrite in (False, True):
        with pytest.raises(PipelineError, match="not a stage's output .*does not delete"):
            _run(tmp_path, overwrite=overwrite)
        # a stage that fills its output in place and resumes (training, eval) does not write into it either
        with pytest.raises(PipelineError, match="not a stage's output"):
            StageOutput("unit", Cfg(output=str(tmp_path / "out"), overwrite=overwrite), []).done(resume=True)
    assert (tmp_path / "out" / "state.json").exists()
    empty = tmp_path / "mount"
    empty.mkdir()  # an empty directory that may not be removable (a mount point): written into, never deleted
    out = StageOutput("unit", Cfg(output=str(empty)), [])
    assert out.done(resume=True) is False and out.replace is False


@pytest.mark.parametrize("record", [MANIFEST, "run_started.json"])
@pytest.mark.parametrize("content", ['{"name": "My app", "icons": []}', '["not", "an", "object"]'])
def test_a_directory_whose_manifest_no_stage_wrote_is_never_deleted(tmp_path, record, content):
    """A web app's manifest.json (or any file of that name, or of the run record's) does not make a directory a
    stage's output: --overwrite replaced the whole directory, the app's files with it."""
    app = tmp_path / "out"
    (app / "src").mkdir(parents=True)
    (app / record).write_text(content)
    (app / "src" / "app.js").write_text("console.log(1)")
    for overwrite in (False, True):
        for resume in (None, True):
            with pytest.raises(PipelineError, match=f"its {record} is not one a stage wrote .*does not delete"):
                StageOutput("unit", Cfg(output=str(app), overwrite=overwrite), []).done(resume=resume)
    assert sorted(p.name for p in app.rglob("*")) == sorted([record, "src", "app.js"])


def test_an_output_that_is_or_holds_an_input_is_refused_even_with_overwrite(tmp_path):
    """``rlhf generate --model pc --output pc --overwrite`` deleted the model it had just sampled from; an output
    holding the prompts file, or the input dataset itself (a stage output, with a manifest), went the same way."""
    _run(tmp_path)  # out/ is a finished stage output
    prompts = write_jsonl(tmp_path / "out" / "p.jsonl", [{"prompt": "a"}])
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cases = [(dict(output=str(tmp_path / "out")), [parse_ref(prompts)], "holds .*p.jsonl, which this run reads"),
             (dict(output=str(tmp_path / "out")), [parse_ref(str(tmp_path / "out"))], "is .*out, which this run reads"),
             (dict(output=str(model), model=str(model)), [], "is .*model, which this run reads")]
    for options, inputs, match in cases:
        out = StageOutput("unit", Cfg(value=1, overwrite=True, **options), inputs)
        with pytest.raises(PipelineError, match=match):
            out.done()
    assert Path(prompts).exists() and (model / "config.json").exists()


def test_failed_write_leaves_nothing_and_keeps_the_old_output(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as tmp:
            (tmp / "half").write_text("partial")
            raise RuntimeError("crash mid-write")
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []
    _run(tmp_path)
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as tmp:
            raise RuntimeError("crash while replacing")
    assert load_from_disk(str(target))["x"] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_output_reaches_the_disk_before_the_rename_that_publishes_it(tmp_path, monkeypatch):
    """Every file and directory of the new output is flushed before it is renamed into place, and the rename after:
    after a power cut, a ``manifest.json`` in place means the data beside it was written whole."""
    import os

    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", f"{a} -> {b}")), real_rename(a, b))[1])
    target = tmp_path / "out"
    with atomic_directory(target) as tmp:
        (tmp / "sub").mkdir()
        for name in ("a.arrow", "sub/b.arrow", "manifest.json"):
            (tmp / name).write_text(name)
    renamed = [i for i, (kind, _) in enumerate(events) if kind == "rename"]
    assert len(renamed) == 1 and events[renamed[0]][1] == f"{tmp} -> {target}"
    before = {path for kind, path in events[:renamed[0]] if kind == "fsync"}
    assert before == {str(tmp), *(str(tmp / n) for n in ("a.arrow", "sub/b.arrow", "manifest.json", "sub"))}
    assert events[renamed[0] + 1:] == [("fsync", str(tmp_path))]


def test_stale_temporary_directory_of_a_killed_run_is_removed(tmp_path):
    stale = tmp_path / ".out.tmp-deadbeef"
    stale.mkdir()
    _run(tmp_path)
    assert not stale.exists()


def test_only_an_outputs_own_leftovers_are_removed_whatever_its_name(tmp_path):
    """Glob characters in an output's name match themselves: ``gen*``'s leftovers are its own, not ``gen_b``'s."""
    theirs, ours = tmp_path / ".gen_b.stream-1234", tmp_path / ".gen*.tmp-1234"
    theirs.mkdir()
    ours.mkdir()
    clean_stale(tmp_path / "gen*")
    assert theirs.exists() and not ours.exists()
    bracket = tmp_path / ".exp[1].tmp-1234"
    bracket.mkdir()
    clean_stale(tmp_path / "exp[1]")
    assert not bracket.exists()


def test_an_output_a_kill_left_half_replaced_is_put_back(tmp_path):
    """Killed between atomic_directory's two renames, the old output is put back, not deleted with the new one."""
    _run(tmp_path)
    (tmp_path / "out").rename(tmp_path / ".out.old-1234")
    (tmp_path / ".out.tmp-5678").mkdir()  # the new version, never put in place
    assert _run(tmp_path) is None  # the run it holds, found again: nothing to do
    assert load_from_disk(str(tmp_path / "out"))["x"] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # an old version alone (killed after both renames, the output deleted by hand since) is not brought back
    (tmp_path / "out").rename(tmp_path / ".out.old-1234")
    clean_stale(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_push_to_hub_uploads_data_and_manifest(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(Dataset, "push_to_hub", lambda self, repo, **kw: calls.append(("data", repo)))

    class FakeApi:
        def file_exists(self, repo_id, filename, **kw):
            return False  # a new repo: no earlier manifest to delete

        def upload_file(self, **kw):
            calls.append(("file", kw["repo_id"], kw["path_in_repo"], json.loads(kw["path_or_fileobj"])))

    monkeypatch.setattr("huggingface_hub.HfApi", FakeApi)
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_value")
    out = StageOutput("unit", Cfg(output=str(tmp_path / "out"), push_to_hub="org/name"), [])
    out.save(Dataset.from_dict({"x": [1]}), rows_in=1)
    assert calls[0] == ("data", "org/name")
    assert calls[1][:3] == ("file", "org/name", MANIFEST)
    assert "hf_secret_token_value" not in json.dumps(calls[1][3])
    assert calls[1][3]["push"] == {"repo_id": "org/name", "pushed": True}
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["push"] == {"repo_id": "org/name", "pushed": True}


def test_a_pending_push_is_not_complete_for_iterate_and_is_uploaded_by_the_stage(tmp_path, monkeypatch):
    """rlhf iterate asks ``done(push=False)`` and ``push_pending()``: an output whose upload failed is launched again
    (the stage then uploads it without recomputing); once pushed, and for another repo, as it should be."""
    uploads = []
    out = StageOutput("unit", Cfg(output=str(tmp_path / "out")), [])
    out.save(Dataset.from_dict({"x": [1]}), rows_in=1)  # no push asked: nothing pending
    assert not out.push_pending()
    pusher = lambda path, hub, manifest: uploads.append((hub.repo_id, json.loads(manifest)["push"]))  # noqa: E731
    again = StageOutput("unit", Cfg(output=str(tmp_path / "out"), push_to_hub="org/a"), [], pusher=pusher)
    assert again.done(push=False) and again.push_pending() and uploads == []
    assert again.done() and uploads == [("org/a", {"repo_id": "org/a", "pushed": True})]
    assert not again.push_pending()
    other = StageOutput("unit", Cfg(output=str(tmp_path / "out"), push_to_hub="org/b"), [], pusher=pusher)
    assert other.push_pending()  # another repo has not had it
    place = StageOutput("unit", Cfg(output=str(tmp_path / "out"), push_to_hub="org/a", hub_config="c"), [],
                        pusher=pusher)
    assert place.push_pending()  # nor another configuration of the same repo


def test_parse_ref_reads_a_hub_configuration():
    ref = parse_ref("org/run#iter1-filter:train@abc123")
    assert (ref.kind, ref.location, ref.config, ref.split, ref.revision) == (
        "hub", "org/run", "iter1-filter", "train", "abc123")
    assert str(ref) == "org/run#iter1-filter:train@abc123"
    assert parse_ref("org/run").config is None
    assert fingerprint(parse_ref("org/run#iter1-score")) != fingerprint(parse_ref("org/run#iter1-filter"))


def test_outputs_pushed_to_configurations_of_one_private_repo_load_back_with_their_manifests(tmp_path, monkeypatch):
    """--hub-config puts each output in a configuration of the one repo, its manifest in manifests/; --private
    creates the repo private; ORG/NAME#CONFIG reads the data and the manifest back, and pull_output makes the stage
    output again, with the same output_id."""
    hub = tmp_path / "hub"
    fake_hub.install(monkeypatch.setattr, hub)
    scored = StageOutput("score", Cfg(output=str(tmp_path / "score"), push_to_hub="org/run", hub_config="iter1-score",
                                      private=True), [])
    scored.save(Dataset.from_dict({"x": [1, 2]}), rows_in=2)
    pairs = StageOutput("filter", Cfg(output=str(tmp_path / "filter"), push_to_hub="org/run",
                                      hub_config="iter1-filter"), [])
    pairs.save(DatasetDict({"train": Dataset.from_dict({"x": [1]}), "test": Dataset.from_dict({"x": [2]})}), rows_in=2)
    assert fake_hub.is_private(hub, "dataset", "org/run")
    assert load_dataset_ref(parse_ref("org/run#iter1-score"))["x"] == [1, 2]
    assert load_dataset_ref(parse_ref("org/run#iter1-filter:test"))["x"] == [2]
    manifest = read_manifest(parse_ref("org/run#iter1-score"))
    assert manifest["push"] == {"repo_id": "org/run", "config": "iter1-score", "pushed": True}
    assert manifest == json.loads((tmp_path / "score" / MANIFEST).read_text())
    for name, config in (("score", "iter1-score"), ("filter", "iter1-filter")):
        target = HubTarget("org/run", config)
        local = json.loads((tmp_path / name / MANIFEST).read_text())
        assert hub_manifest(target, model=False) == local
        pull_output(target, tmp_path / "pulled" / name, hub_manifest(target, model=False), model=False)
        assert read_manifest(parse_ref(str(tmp_path / "pulled" / name)))["output_id"] == local["output_id"]
    assert load_dataset_ref(parse_ref(str(tmp_path / "pulled" / "score")))["x"] == [1, 2]
    assert sorted(load_dataset_dict(parse_ref(str(tmp_path / "pulled" / "filter")))) == ["test", "train"]
    assert hub_manifest(HubTarget("org/run", "iter2-score"), model=False) is None  # nothing pushed there


def test_a_manifest_names_the_commit_of_the_code_that_wrote_it(tmp_path):
    """Every commit of a checkout is version 0.1.0: run from a git checkout, the manifest also records the commit
    and whether tracked files were changed from it."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    if not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    StageOutput("unit", Cfg(output=str(tmp_path / "out")), []).save(Dataset.from_dict({"x": [1]}), rows_in=1)
    source = json.loads((tmp_path / "out" / MANIFEST).read_text())["source"]
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert source["commit"] == head.strip() and isinstance(source["modified"], bool)


def test_a_hub_dataset_input_records_the_commit_it_was_read_at(tmp_path, monkeypatch):
    """A Hub input is recorded with the commit its revision named when the stage read it (the manifest says which
    data it was), and is identified by the revision as given: a commit covers the whole repo, so another
    configuration pushed beside it is no new data; @COMMIT pins it. A pushed stage output is its manifest's
    output_id, as its local copy, whatever else the repo holds."""
    hub = tmp_path / "hub"
    fake_hub.install(monkeypatch.setattr, hub)
    Dataset.from_dict({"prompt": ["a", "b"]}).push_to_hub("org/prompts")
    ref = parse_ref("org/prompts")
    out = StageOutput("unit", Cfg(output=str(tmp_path / "out")), [ref])
    out.save(load_dataset_ref(ref), rows_in=2)
    record = json.loads((tmp_path / "out" / MANIFEST).read_text())["inputs"][0]
    first = record["commit"]
    assert record == {"ref": "org/prompts", "kind": "hub", "fingerprint": "hub:org/prompts@main", "split": None,
                      "commit": first} and len(first) == 40

    Dataset.from_dict({"x": [1]}).push_to_hub("org/prompts", config_name="other")  # the repo's commit moves
    hub_commit.cache_clear()  # a new stage process
    assert hub_commit("org/prompts", None) != first
    assert StageOutput("unit", Cfg(output=str(tmp_path / "out")), [ref]).done()  # the same data asked for
    pinned = parse_ref(f"org/prompts@{first}")
    assert fingerprint(pinned) == f"hub:org/prompts@{first}" and hub_commit("org/prompts", first) == first

    scored = StageOutput("score", Cfg(output=str(tmp_path / "score"), push_to_hub="org/run", hub_config="s"), [])
    scored.save(Dataset.from_dict({"x": [1]}), rows_in=1)
    output_id = json.loads((tmp_path / "score" / MANIFEST).read_text())["output_id"]
    Dataset.from_dict({"x": [2]}).push_to_hub("org/run", config_name="t")
    assert fingerprint(parse_ref("org/run#s")) == fingerprint(parse_ref(str(tmp_path / "score"))) == output_id


@pytest.mark.parametrize("revision", [None, "v1.0", "refs/pr/3"])
def test_a_hub_dataset_is_loaded_at_the_commit_its_revision_named(monkeypatch, revision):
    """The commit recorded is the commit read: load_dataset is given it, for a branch, a tag or a pull request; where
    no commit is known (offline, never fetched), the revision as given."""
    import datasets

    import rlhf_pipeline.datasets_io as dio

    asked = []

    def load_dataset(path, name=None, revision=None, **kw):
        asked.append((path, name, revision))
        return Dataset.from_dict({"prompt": ["a"]})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    commits = {("org/p", revision): "a" * 40}
    monkeypatch.setattr(dio, "hub_commit", lambda repo, rev: commits.get((repo, rev)))
    text = "org/p#cfg" + (f"@{revision}" if revision else "")
    load_dataset_ref(parse_ref(text))
    assert input_record(parse_ref(text))["commit"] == "a" * 40
    commits.clear()
    load_dataset_ref(parse_ref(text))
    assert asked == [("org/p", "cfg", "a" * 40), ("org/p", "cfg", revision)]


def test_a_hub_stage_output_recorded_by_its_revision_matches_its_output_id_and_nothing_local_does():
    """Before this version a Hub stage output was recorded by the revision asked for ('hub:ORG/NAME#CONFIG@main'),
    and offline its manifest may be out of reach: either side so matches the other's output_id of the same Hub
    reference. A local input never does: a relative directory since deleted reads as a Hub id, and a directory
    named like a Hub dataset is not that dataset."""
    old = {"ref": "org/run#s", "fingerprint": "hub:org/run#s@main", "split": None}  # no kind: an older record
    now = {"ref": "org/run#s", "kind": "hub", "fingerprint": "f" * 32, "split": None}
    offline = {**now, "fingerprint": "hub:org/run#s@main"}
    assert same_inputs([old], [now]) and same_inputs([now], [offline])
    assert not same_inputs([now], [{**now, "fingerprint": "e" * 32}])
    assert not same_inputs([old], [{**now, "ref": "org/run#t", "fingerprint": "hub:org/run#t@main"}])
    assert not same_inputs([{**old, "split": "test"}], [{**now, "split": "train"}])
    assert not same_inputs([old], [now, now])
    gone = {"ref": "runs/x", "kind": "hub", "fingerprint": "hub:runs/x@main", "split": None}
    assert not same_inputs([{"ref": "runs/x", "kind": "dir", "fingerprint": "f" * 32, "split": None}], [gone])
    assert not same_inputs([{"ref": "runs/x", "fingerprint": "f" * 32, "split": None}], [gone])
    assert not same_inputs([{"ref": "org/p", "fingerprint": "hub:org/p@main", "split": None}],
                           [{"ref": "org/p", "kind": "dir", "fingerprint": "datasets:0", "split": None}])


def test_offline_a_hub_commit_is_the_one_the_hub_cache_last_saw(tmp_path, monkeypatch, caplog):
    """HF_HUB_OFFLINE (the tests' setting): the Hub is not asked; the local Hub cache's refs/<branch>, which
    huggingface_hub writes when it downloads at a branch, gives the commit, or none is known. A manifest out of
    reach is no warning here (a user's dataset has none): the stages that read lineage warn."""
    from huggingface_hub import constants

    import rlhf_pipeline.datasets_io as dio

    monkeypatch.setattr(dio, "_WARNED", set())

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    refs = tmp_path / "datasets--org--cached" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("c" * 40 + "\n")
    assert hub_commit("org/cached", None) == "c" * 40
    assert hub_commit("org/cached", "dev") is None
    assert hub_commit("org/cached", "d" * 40) == "d" * 40  # a commit names itself
    with caplog.at_level("WARNING", logger="rlhf_pipeline.datasets_io"):
        assert input_record(parse_ref("org/cached:train"))["commit"] == "c" * 40
        assert input_record(parse_ref("org/never#cfg"))["commit"] is None
        assert fingerprint(parse_ref("org/never#cfg")) == "hub:org/never#cfg@main"
    assert caplog.records == []
    with caplog.at_level("WARNING", logger="rlhf_pipeline.datasets_io"):
        assert read_manifest(parse_ref("org/never#cfg")) is None
    assert "is neither in the Hub cache nor reachable" in caplog.text


def test_a_dataset_push_cut_before_its_manifest_leaves_no_earlier_manifest_beside_the_new_data(tmp_path,
                                                                                                monkeypatch):
    """A configuration pushed again (a rerun, --overwrite) whose manifest upload fails after its data went up: the
    earlier run's manifest is gone, so the configuration reads as not pushed (iterate --resume runs the stage again)
    instead of as the earlier run with this run's rows."""
    hub = tmp_path / "hub"
    fake_hub.install(monkeypatch.setattr, hub)
    from huggingface_hub import HfApi  # the fake's
    target = HubTarget("org/run", "iter1-score")
    first = StageOutput("score", Cfg(output=str(tmp_path / "a"), push_to_hub="org/run", hub_config="iter1-score"), [])
    first.save(Dataset.from_dict({"x": [1, 2]}), rows_in=2)
    assert hub_manifest(target, model=False)["rows_out"] == 2

    def manifest_upload_fails(self, path_or_fileobj, path_in_repo, repo_id, **kw):
        raise OSError("connection reset")

    monkeypatch.setattr(HfApi, "upload_file", manifest_upload_fails)
    second = StageOutput("score", Cfg(output=str(tmp_path / "b"), push_to_hub="org/run", hub_config="iter1-score"),
                         [])
    with pytest.raises(PipelineError, match="the upload failed"):
        second.save(Dataset.from_dict({"x": [7, 8, 9]}), rows_in=3)
    assert load_dataset_ref(parse_ref("org/run#iter1-score"))["x"] == [7, 8, 9]  # the data went up
    assert hub_manifest(target, model=False) is None


@pytest.mark.parametrize("model", [False, True])
def test_a_pull_the_network_cuts_is_one_line_without_the_token_and_leaves_nothing(tmp_path, monkeypatch, model):
    """iterate --resume pulls finished outputs from the Hub: a connection lost midway was a raw traceback (or, with
    a stage running beside it, its message unredacted); it is one line, and nothing is left at the path."""
    import requests

    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnopqrstuvwxyz0123")

    def cut(*args, **kwargs):
        raise requests.ConnectionError("Connection reset by peer (token hf_abcdefghijklmnopqrstuvwxyz0123)")

    monkeypatch.setattr("huggingface_hub.snapshot_download" if model else "datasets.load_dataset", cut)
    target = tmp_path / "iter1" / "score"
    with pytest.raises(PipelineError) as error:
        pull_output(HubTarget("org/run", "iter1-score"), target, {"rows_out": 2}, model=model)
    message = str(error.value)
    assert message.startswith("--push-to-hub org/run#iter1-score: pulling the finished score") and "\n" not in message
    assert "ConnectionError" in message and "hf_abcdefghijklmnopqrstuvwxyz0123" not in message
    assert not target.exists() and not list(target.parent.glob("*"))


@pytest.mark.parametrize("branch", [None, "iter1-train"])
def test_a_model_pushed_again_replaces_the_files_of_the_one_before(tmp_path, monkeypatch, branch):
    """A second push to the same place (a rerun, --overwrite) leaves none of the first model's files: a stale single
    model.safetensors beside new shards is what transformers would load. The user's model card stays, and the
    manifest is the new one."""
    from rlhf_pipeline.training.stage import push_model_to_hub

    hub = tmp_path / "hub"
    fake_hub.install(monkeypatch.setattr, hub)
    first = tmp_path / "first"
    first.mkdir()
    for name in ("model.safetensors", "config.json", "adapter_config.json", "odd[1].json"):
        (first / name).write_text("old")
    push_model_to_hub(first, HubTarget("org/m", branch), b'{"output_id": "a"}')
    files = hub / "model" / "org/m" / "rev" / (branch or "main")
    (files / "README.md").write_text("the user's card")
    second = tmp_path / "second"
    (second / "checkpoints").mkdir(parents=True)
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json", "config.json", "checkpoints/step-4.bin"):
        (second / name).write_text("new")
    push_model_to_hub(second, HubTarget("org/m", branch), b'{"output_id": "b"}')
    assert sorted(str(f.relative_to(files)) for f in files.rglob("*") if f.is_file()) == sorted([
        MANIFEST, "README.md", "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json"])
    assert (files / "config.json").read_text() == "new" and (files / "README.md").read_text() == "the user's card"
    assert json.loads((files / MANIFEST).read_text()) == {"output_id": "b"}


@pytest.mark.parametrize("options,message", [
    ({"hub_config": "iter1-score"}, "--hub-config iter1-score without --push-to-hub"),
    ({"private": True}, "--private without --push-to-hub"),
    ({"push_to_hub": "org/run", "hub_config": "a/b"}, "--hub-config a/b: use letters, digits"),
])
def test_hub_options_without_a_repo_or_with_a_bad_name_are_one_line(tmp_path, options, message):
    with pytest.raises(PipelineError, match=message):
        StageOutput("unit", Cfg(output=str(tmp_path / "out"), **options), [])


@pytest.mark.parametrize("error", ["offline", "server"])
def test_a_hub_that_cannot_be_read_is_one_line_not_an_empty_repo(monkeypatch, error):
    """iterate --resume reads each stage's manifest on the Hub: not finding one means the stage runs, but not reaching
    the Hub is an error (else an offline resume would recompute everything)."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    def download(*args, **kw):
        raise LocalEntryNotFoundError("outgoing traffic has been disabled") if error == "offline" else \
            RuntimeError("500 Server Error")

    monkeypatch.setattr("huggingface_hub.hf_hub_download", download)
    with pytest.raises(PipelineError, match=r"--push-to-hub org/run#iter1-score: could not read its "
                                            r"manifests/iter1-score\.json"):
        hub_manifest(HubTarget("org/run", "iter1-score"), model=False)


def test_an_input_manifest_out_of_reach_is_a_warning_and_a_broken_hub_an_error(monkeypatch, tmp_path, caplog):
    """A Hub input's manifest carries lineage (sampling settings, shard, row count): offline and not cached, the
    checks it feeds are skipped with a warning, once, rather than without a word; any other failure is one line."""
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    import rlhf_pipeline.datasets_io as dio

    failure: list[Exception] = []

    def download(*args, **kw):
        if failure:
            raise failure[0]
        (tmp_path / "m.json").write_text("{not json")
        return str(tmp_path / "m.json")

    monkeypatch.setattr("huggingface_hub.hf_hub_download", download)
    monkeypatch.setattr(dio, "_WARNED", set())
    ref = parse_ref("org/data#iter1-generate")
    failure[:] = [LocalEntryNotFoundError("outgoing traffic has been disabled")]
    with caplog.at_level("WARNING", logger="rlhf_pipeline.datasets_io"):
        assert read_manifest(ref) is None and read_manifest(ref) is None
    warned = [r.getMessage() for r in caplog.records]
    assert warned == ["org/data#iter1-generate: its manifests/iter1-generate.json is neither in the Hub cache "
                      "nor reachable; what it records (sampling, shard, rows) is not checked (unset HF_HUB_OFFLINE to "
                      "check it)"]
    failure[:] = [EntryNotFoundError("404")]
    assert read_manifest(ref) is None  # a dataset no stage wrote
    failure[:] = [RuntimeError("500 Server Error\ntraceback")]
    with pytest.raises(PipelineError, match=r"^org/data#iter1-generate: could not read its manifests/iter1-generate"
                                            r"\.json \(RuntimeError: 500 Server Error\); check HF_TOKEN"):
        read_manifest(ref)
    failure.clear()
    with pytest.raises(PipelineError, match=r"org/data#iter1-generate: its manifests/iter1-generate\.json is damaged"):
        read_manifest(ref)


def test_a_piece_made_again_is_absent_until_it_is_whole(tmp_path, monkeypatch):
    """Parts.write of a key that has a piece already (a chunk made again, by another version of its source) removes
    the old rows before it writes the new notes: a kill or a failure in between leaves no piece, never the old rows
    under the new notes, which a rerun would take for the new ones."""
    from datasets import Features, Value

    import rlhf_pipeline.datasets_io as datasets_io
    from rlhf_pipeline.datasets_io import Parts

    parts = Parts(tmp_path / "parts", Features({"rewards": Value("float64")}))
    parts.write("k", {"rewards": [1.0, 2.0]}, {"code": "old"})
    assert parts.get("k")[0]["rewards"] == [1.0, 2.0]

    def cut(*args):  # after the new notes are written, before the new rows take the old ones' place
        raise OSError("the disk went away")

    monkeypatch.setattr(datasets_io, "flush_files", cut)
    with pytest.raises(OSError):
        parts.write("k", {"rewards": [3.0, 4.0]}, {"code": "new"})
    assert parts.get("k") is None
    monkeypatch.undo()
    again = Parts(tmp_path / "parts", Features({"rewards": Value("float64")}))  # a rerun: the cut file removed
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == ["k.json"]  # the new notes alone
    again.write("k", {"rewards": [3.0, 4.0]}, {"code": "new"})
    rows, notes = again.get("k")
    assert (rows["rewards"], notes) == ([3.0, 4.0], {"code": "new"})


def test_tiny_model_again_with_the_same_options_does_nothing_and_with_others_is_refused(tmp_path, capsys):
    """README's "One iteration by hand" run a second time stopped at its first line: tiny-model refused any existing
    directory. The same options build the same files, so the same command again does nothing, as every stage does;
    other options are refused without --overwrite, and the model stays as it was."""
    from conftest import run

    out = tmp_path / "model"
    assert run("tiny-model", "--output", out) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert run("tiny-model", "--output", out) == 0
    assert "already holds this tiny model; nothing to do" in capsys.readouterr().out
    assert run("tiny-model", "--seed", 1, "--output", out) == 1
    assert "holds another model than these options build" in capsys.readouterr().err
    (out / "tokenizer_config.json").write_text("{}")  # a file changed since
    assert run("tiny-model", "--output", out) == 1
    (out / "tokenizer_config.json").write_bytes(before["tokenizer_config.json"])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no build left beside it
    config = json.loads(before["config.json"])
    (out / "config.json").write_text(json.dumps({**config, "transformers_version": "4.0.0"}))  # built before
    (tmp_path / ".model.tmp-killed").mkdir()  # the comparison's build, left by a kill
    assert run("tiny-model", "--output", out) == 0  # an upgrade of transformers builds the same model
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_tiny_model_overwrite_replaces_a_tiny_model_and_nothing_else(tmp_path, capsys):
    """``rlhf tiny-model --overwrite`` replaced any directory (a thesis with it); now only a tiny model's files."""
    from conftest import run

    out = tmp_path / "model"
    assert run("tiny-model", "--output", out) == 0
    assert run("tiny-model", "--seed", 1, "--output", out, "--overwrite") == 0  # a tiny model: replaced
    # by one of another kind or chat format too, whose files differ (no generation config, no chat template)
    assert run("tiny-model", "--kind", "reward", "--chat-format", "base", "--output", out, "--overwrite") == 0
    assert not (out / "chat_template.jinja").exists() and not (out / "generation_config.json").exists()
    assert run("tiny-model", "--kind", "armo", "--output", out, "--overwrite") == 0
    assert run("tiny-model", "--output", out, "--overwrite") == 0
    assert not (out / "modeling_tiny_armo.py").exists()
    thesis = tmp_path / "proj"
    thesis.mkdir()
    (thesis / "thesis.tex").write_text("\\\\begin{document}")
    (thesis / "config.json").write_text("{}")
    capsys.readouterr()
    assert run("tiny-model", "--output", thesis, "--overwrite") == 1
    assert "holds files a tiny model does not (thesis.tex)" in capsys.readouterr().err
    assert sorted(p.name for p in thesis.iterdir()) == ["config.json", "thesis.tex"]
    assert not list(tmp_path.glob(".proj*"))
    (tmp_path / "notes.txt").write_text("mine")
    assert run("tiny-model", "--output", tmp_path / "notes.txt", "--overwrite") == 1
    assert "exists and is a file; choose a directory path" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"
