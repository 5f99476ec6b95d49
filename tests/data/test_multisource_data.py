"""Several training sources in one run (data.sources): the data module draws every batch from one
source, with its own prompts and weight, validates on data.eval_dir, resumes mid-epoch exactly, and
names a bad source; a run trains on two sources and logs each one's pair count."""
from __future__ import annotations

import csv
import json
from collections import Counter

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from moco_retrieval.data.datamodule import RetrievalDataModule
from moco_retrieval.data.formats import DataError
from tests.helpers import compose_cfg, fake_tokenize, make_cfg, two_sources


def test_batches_of_one_source_with_its_prompts(tmp_path):
    dm = RetrievalDataModule(two_sources(tmp_path), fake_tokenize, rank=0, world_size=1)
    dm.setup()
    assert dm.source_offsets.tolist() == [0, 48, 72]
    batches = list(dm.train_dataloader())
    assert len(batches) == 18  # 12 + 6: one pass over each (no weights: by size)
    assert Counter(int(b["source"][0]) for b in batches) == {0: 12, 1: 6}
    for b in batches:
        (src,) = set(b["source"].tolist())
        word, q, d = ("alpha", "query: ", "passage: ") if src == 0 else ("beta", "question: ", "answer: ")
        assert all(t.startswith(f"{q}{word} query") for t in b["query"]["texts"])
        assert all(t.startswith(f"{d}{word} doc") for t in b["doc"]["texts"])
    val = list(dm.val_dataloader())  # validation: data.eval_dir with data.prompts
    assert val[0]["texts"][0] == "passage: eval document 0" and val[-1]["texts"][0].startswith("query: eval query")


def test_weights_and_round_robin(tmp_path):
    weighted = RetrievalDataModule(_weighted(tmp_path, [1, 3]), fake_tokenize, rank=0, world_size=1)
    sources = [int(b["source"][0]) for b in weighted.train_dataloader()]
    assert Counter(sources) == {0: 5, 1: 13}  # 18 batches split 1:3 (source b repeats: a new pass)
    rr = RetrievalDataModule(two_sources(tmp_path, source_mode="round_robin"), fake_tokenize, rank=0, world_size=1)
    assert [int(b["source"][0]) for b in rr.train_dataloader()] == [0, 1] * 6


def _weighted(tmp_path, weights):
    cfg = two_sources(tmp_path)
    for src, w in zip(cfg.sources, weights):
        src.weight = w
    return cfg


def test_resume_mid_epoch_across_sources(tmp_path):
    cfg = _weighted(tmp_path, [2, 1])
    full = [b["index"].tolist() for b in RetrievalDataModule(cfg, fake_tokenize, rank=0, world_size=1).train_dataloader()]
    run = RetrievalDataModule(cfg, fake_tokenize, rank=0, world_size=1)
    for _ in range(5):
        run.on_train_batch_end()
    state = run.state_dict()
    resumed = RetrievalDataModule(cfg, fake_tokenize, rank=0, world_size=1)
    resumed.load_state_dict(state)
    assert [b["index"].tolist() for b in resumed.train_dataloader()] == full[5:]
    assert state["sources"] == {"names": ["a", "b"], "weights": [2.0, 1.0], "mode": "weighted"}
    other = RetrievalDataModule(_weighted(tmp_path, [1, 1]), fake_tokenize, rank=0, world_size=1)
    with pytest.raises(DataError, match=r"in a run on data.sources \['a', 'b'\] \(a=2, b=1\), data.source_mode=weighted, "
                                        r"but this run's config has data.sources \['a', 'b'\] \(a=1, b=1\)"):
        other.load_state_dict(state)
    (tmp_path / "one").mkdir()
    single = RetrievalDataModule(make_cfg(tmp_path / "one"), fake_tokenize, rank=0, world_size=1)
    with pytest.raises(DataError, match=r"this run's config has one source \(no data.sources\)"):
        single.load_state_dict(state)
    with pytest.raises(DataError, match=r"in a run on one source"):
        other.load_state_dict(single.state_dict())


def test_bad_sources_are_named(tmp_path):
    cfg = two_sources(tmp_path)
    (tmp_path / "b.jsonl").write_text('{"query": "q"}\n')
    with pytest.raises(DataError, match=rf"data.sources\[1\] \(b\): {tmp_path / 'b.jsonl'}:1: .*positive"):
        RetrievalDataModule(cfg, fake_tokenize, rank=0, world_size=1).setup()
    for change, message in [
        (dict(train_path=str(tmp_path / "a.jsonl")), "data.train_path and data.sources are both set"),
    ]:
        with pytest.raises(DataError, match=message):
            RetrievalDataModule(two_sources(tmp_path / "x", **change), rank=0, world_size=1).setup()
    cfg = two_sources(tmp_path / "y")
    cfg.sources[0].weight = 1.0
    with pytest.raises(DataError, match=r"give every source a weight or none \(no weight: b\)"):
        RetrievalDataModule(cfg, rank=0, world_size=1).setup()
    cfg.sources[1].name = "a"
    with pytest.raises(DataError, match="the name 'a' is given to more than one source"):
        RetrievalDataModule(cfg, rank=0, world_size=1).setup()
    small = RetrievalDataModule(two_sources(tmp_path / "z", n_b=3), rank=0, world_size=1)
    with pytest.raises(DataError, match=r"data.sources\[1\] \(b\) has 3 rows: no full batch of 4 x 1 rank"):
        small.train_dataloader()


def test_sources_compose_strictly_from_the_command_line(tmp_path):
    sources = "[{name: a, train_path: a.jsonl, weight: 2}, {name: b, kind: parquet, train_path: b.parquet, prompts: {query: 'q: '}}]"
    cfg = compose_cfg("train", ["data=jsonl", f"data.sources={sources}", "data.source_mode=round_robin"])
    assert [s.name for s in cfg.data.sources] == ["a", "b"] and cfg.data.sources[0].weight == 2
    assert cfg.data.sources[1].prompts.query == "q: " and cfg.data.sources[1].prompts.doc == ""
    assert cfg.data.sources[1].columns.query == "query"
    with pytest.raises(ConfigCompositionException):
        compose_cfg("train", ["data=jsonl", "data.sources=[{name: a, train_file: a.jsonl}]"])


def test_a_run_on_two_sources_logs_each_ones_pairs(tmp_path, one_thread):
    from moco_retrieval.train import train

    data = two_sources(tmp_path / "data", n_a=64, n_b=32)
    sources = "[" + ", ".join(f"{{name: {s.name}, train_path: '{s.train_path}'}}" for s in data.sources) + "]"
    cfg = OmegaConf.to_object(compose_cfg("train", [
        "+experiment=smoke", "data=jsonl", f"data.sources={sources}", f"data.eval_dir={data.eval_dir}",
        "data.max_eval_queries=null", "data.max_eval_docs=null", "logger=csv", "trainer.val_check_interval=null",
        "data.prompts.query='query: '"]))
    train(cfg, tmp_path / "run")
    rows = list(csv.DictReader((tmp_path / "run" / "csv" / "metrics.csv").open()))
    totals = {k: float(v) for r in rows for k, v in r.items() if k.startswith("train/pairs_source_") and v}
    assert totals == {"train/pairs_source_0": 64.0, "train/pairs_source_1": 32.0}  # 16-pair batches: 4 + 2
    hparams = json.loads(json.dumps(OmegaConf.to_container(OmegaConf.load(tmp_path / "run" / "config.yaml"))))
    assert [s["name"] for s in hparams["data"]["sources"]] == ["a", "b"]


def test_unset_source_keys_are_the_data_configs(tmp_path):
    cfg = two_sources(tmp_path, max_train_examples=20)  # every source capped at 20 ...
    cfg.sources[1].max_train_examples = 8  # ... but b at its own 8
    dm = RetrievalDataModule(cfg, rank=0, world_size=1)
    dm.setup()
    assert dm.source_offsets.tolist() == [0, 20, 28]
    assert {p.query.split()[0] for p in dm.train_pairs[20:]} == {"beta"}


def test_frozen_features_are_warmed_for_the_prompted_texts(tiny_dir, tmp_path):
    """train.py's warm-up fills the frozen backbone's cache with the texts the batches hold (each
    source's prompts, data.prompts for the pool): training and validation compute nothing more."""
    from moco_retrieval.config import ModelConfig
    from moco_retrieval.model.encoder import build_encoder
    from moco_retrieval.train import warm_frozen_features

    enc = build_encoder(ModelConfig(backbone="tiny", path=tiny_dir, frozen_backbone=True,
                                    feature_cache_dir=None))
    dm = RetrievalDataModule(two_sources(tmp_path / "data", n_a=16, n_b=8), None, rank=0, world_size=1)
    dm.setup()
    cache = enc.feature_cache
    assert warm_frozen_features(enc, dm) > 0
    before = cache.computed
    for batch in dm.train_dataloader():
        enc(batch["query"], "query"), enc(batch["doc"], "doc")
    for batch in dm.val_dataloader():
        enc(batch, batch["kind"])
    assert cache.computed == before


def test_a_source_without_a_name_is_named_by_its_position(tmp_path):
    cfg = two_sources(tmp_path)
    cfg.sources[1].name = None
    (tmp_path / "b.jsonl").write_text("not json\n")
    with pytest.raises(DataError, match=r"data.sources\[1\] \(1\): .*b.jsonl:1: malformed JSON"):
        RetrievalDataModule(cfg, rank=0, world_size=1).setup()


@pytest.mark.parametrize("source,named", [("{name: faq, train_path: faq.jsonl, weight: -1}", "data.sources[faq]"),
                                          ("{train_path: pairs/faq.jsonl, weight: -1}", "data.sources[pairs/faq.jsonl]")])
def test_a_sources_value_out_of_range_names_the_source(source, named):
    """Said by its name, else by its file (a source does not know its position in the list)."""
    from moco_retrieval.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        compose_cfg("train", ["data=jsonl", "data.eval_dir=ev", f"data.sources=[{{name: web, train_path: w.jsonl}}, {source}]"],
                    to_object=True)
    assert str(err.value) == f"{named}.weight=-1.0: must be >= 0"
