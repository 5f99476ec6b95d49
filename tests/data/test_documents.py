"""Documents alone (data=documents): every input form, located errors, the views and their
determinism across resume, workers and ranks, sibling views masked by id, one source among several."""
import json
import re

import numpy as np
import pytest
import torch

from moco_retrieval.config import ColumnsConfig, DataConfig, SourceConfig, ViewsConfig
from moco_retrieval.data.datamodule import RetrievalDataModule
from moco_retrieval.data.documents import HELD_OUT_MAX, crop, delete, held_out, make_views
from moco_retrieval.data.formats import DataError, Pair
from moco_retrieval.data.ids import doc_id_for_text, stable_id
from moco_retrieval.errors import ConfigError
from tests.helpers import write_eval, write_jsonl

WORDS = "amber birch cedar dune ember fjord grove heath islet jade kelp loch moor nook oak pine quay reed".split()


def _docs(n=40, seed=0):
    rng = np.random.default_rng(seed)
    return [{"id": f"doc{i}", "title": f"title {i}",
             "text": f"first sentence of {i}. " + " ".join(rng.choice(WORDS, size=int(rng.integers(20, 60))))}
            for i in range(n)]


def _cfg(tmp_path, docs=None, **kw):
    path = write_jsonl(tmp_path / "docs.jsonl", docs or _docs())
    args = dict(kind="documents", path=str(path), batch_size=4, eval_batch_size=8, cache_dir=str(tmp_path / "cache"))
    args.update(kw)
    return DataConfig(**args)


def _texts(dm, epoch=0):
    dm.batch_sampler.set_epoch(epoch)
    return [(b["index"].tolist(), b["query"]["texts"], b["doc"]["texts"], b["doc_id"].tolist())
            for b in dm.train_dataloader()]


# ------------------------------------------------------------------------------------ input forms


def _stored(dm):
    return sorted((p.query_id, p.query, p.positive, p.doc_id) for p in dm.train_rows.pairs())


def test_every_input_form_stores_the_same_documents(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _docs(30)
    renamed = [{"body": d["text"], "heading": d["title"], "key": d["id"]} for d in docs]
    cols = ColumnsConfig(text="body", title="heading", id="key")
    pq.write_table(pa.Table.from_pylist(renamed), tmp_path / "docs.parquet")
    import csv
    with open(tmp_path / "docs.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["body", "heading", "key"])
        w.writeheader()
        w.writerows(renamed)
    datasets.Dataset.from_list(renamed).save_to_disk(str(tmp_path / "ds"))
    eval_dir = write_eval(tmp_path / "eval")
    common = dict(kind="documents", batch_size=4, cache_dir=str(tmp_path / "cache"), eval_dir=str(eval_dir))
    reference = _stored(RetrievalDataModule(_cfg(tmp_path, docs, eval_dir=str(eval_dir))))
    assert len(reference) == 30 and reference[0][3] == stable_id(reference[0][0])
    for path in ("docs.parquet", "docs.csv", "ds"):
        dm = RetrievalDataModule(DataConfig(path=str(tmp_path / path), columns=cols, **common))
        assert _stored(dm) == reference, path


def test_a_folder_of_text_files_is_a_document_each(tmp_path):
    (tmp_path / "corpus" / "sub").mkdir(parents=True)
    (tmp_path / "corpus" / "a.txt").write_text("alpha text here")
    (tmp_path / "corpus" / "sub" / "b.md").write_text("# beta\nmarkdown body")
    (tmp_path / "corpus" / "skip.json").write_text("{}")
    eval_dir = write_eval(tmp_path / "eval")
    dm = RetrievalDataModule(DataConfig(kind="documents", path=str(tmp_path / "corpus"), eval_dir=str(eval_dir),
                                        batch_size=1, cache_dir=str(tmp_path / "cache")))
    assert _stored(dm) == sorted([("a.txt", "", "alpha text here", stable_id("a.txt")),
                                  ("sub/b.md", "", "# beta\nmarkdown body", stable_id("sub/b.md"))])


@pytest.mark.parametrize("rows,message", [
    ([{"text": "fine"}, {"title": "no text"}], r"docs\.jsonl:2: column 'text' \(data\.columns\.text\): expected the document's text, got nothing"),
    ([{"text": "fine"}, {"text": "  "}], r"docs\.jsonl:2: column 'text' \(data\.columns\.text\) is empty"),
    ([{"text": "fine", "id": 1.5}], r"docs\.jsonl:1: column 'id' \(data\.columns\.id\): expected a non-empty string or integer id"),
    ([{"text": "fine", "title": 3}], r"docs\.jsonl:1: column 'title' \(data\.columns\.title\): expected a text, got int"),
])
def test_bad_documents_are_located(tmp_path, rows, message):
    with pytest.raises(DataError, match=message):
        RetrievalDataModule(_cfg(tmp_path, rows)).setup("fit")


def test_bad_csv_row_and_missing_column_are_located(tmp_path):
    (tmp_path / "d.csv").write_text("text,title\nok,t\n,t2\n")
    cfg = DataConfig(kind="documents", path=str(tmp_path / "d.csv"), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"d\.csv: row 3: column 'text' \(data\.columns\.text\): expected the document's text, got nothing"):
        RetrievalDataModule(cfg).setup("fit")
    cfg = DataConfig(kind="documents", path=str(tmp_path / "d.csv"), columns=ColumnsConfig(text="body"),
                     cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"d\.csv: no column 'body' \(data\.columns\.text\); its columns: text, title"):
        RetrievalDataModule(cfg).setup("fit")


def test_options_of_another_kind_are_config_errors():
    with pytest.raises(ConfigError, match=r"data\.columns\.query='q' is not read with data\.kind=documents"):
        DataConfig(kind="documents", columns=ColumnsConfig(query="q"))
    with pytest.raises(ConfigError, match=r"data\.columns\.text='body' is not read with data\.kind=jsonl"):
        DataConfig(kind="jsonl", columns=ColumnsConfig(text="body"))
    with pytest.raises(ConfigError, match=r"data\.views is read with data\.kind=documents only"):
        DataConfig(kind="jsonl", views=ViewsConfig(deletion=0.0))
    with pytest.raises(ConfigError, match=r"data\.views\.crop_min=0\.6 is above data\.views\.crop_max=0\.5"):
        ViewsConfig(crop_min=0.6)
    from tests.helpers import compose_cfg

    with pytest.raises(ConfigError, match=r"model\.frozen_backbone=true with documents"):
        compose_cfg("train", ["data=documents", "data.path=x.jsonl", "model=frozen_head", "objective=feature_memory"],
                    to_object=True)


# ------------------------------------------------------------------------------------------ views


def test_crops_are_spans_of_the_configured_share_and_deletion_drops_about_p():
    words = [f"w{i}" for i in range(200)]
    rng = np.random.default_rng(0)
    for _ in range(200):
        span = crop(words, rng, 0.1, 0.5)
        start = words.index(span[0])
        assert span == words[start : start + len(span)] and 20 <= len(span) <= 100
    kept = sum(len(delete(words, np.random.default_rng(s), 0.1)) for s in range(50)) / (50 * 200)
    assert 0.88 < kept < 0.92
    assert delete(["only"], np.random.default_rng(1), 0.99) == ["only"]


def test_title_and_first_sentence_pairs_fall_back_to_crops():
    pair = Pair(query="The title", positive="First one. Then the rest of it.", doc_id=1)
    no_title = Pair(query="", positive="one two three four five six seven eight nine ten", doc_id=2)
    keep = dict(crop_min=0.1, crop_max=0.5, deletion=0.0)
    rng = lambda: np.random.default_rng(0)  # noqa: E731
    assert make_views(pair, rng(), ViewsConfig(pairs="title", **keep)) == ("The title", "First one. Then the rest of it.")
    assert make_views(pair, rng(), ViewsConfig(pairs="first_sentence", **keep)) == ("First one.", "Then the rest of it.")
    for mode in ("title", "first_sentence"):  # no title, no second sentence: two crops, as pairs=crops makes them
        assert make_views(no_title, rng(), ViewsConfig(pairs=mode, **keep)) == \
            make_views(no_title, rng(), ViewsConfig(pairs="crops", **keep))


# ------------------------------------------------------------------------------------ determinism


def test_views_are_a_function_of_seed_epoch_step_row_through_resume_and_workers(tmp_path):
    cfg = _cfg(tmp_path)
    full = _texts(RetrievalDataModule(cfg), epoch=1)
    stored = {p.doc_id: p.positive for p in RetrievalDataModule(cfg).train_rows.pairs()}
    for rows, queries, docs, ids in full:
        for q, d, i in zip(queries, docs, ids):
            assert q != d and set(q.split()) <= set(stored[i].split()) and set(d.split()) <= set(stored[i].split())
    assert _texts(RetrievalDataModule(cfg), epoch=1) == full  # the same draw again
    assert [t[1] for t in _texts(RetrievalDataModule(cfg), epoch=2)] != [t[1] for t in full]  # new views each epoch
    # a DataLoader worker process receives the draw's epoch and step with the rows
    workers = DataConfig(**{**cfg.__dict__, "num_workers": 1})
    assert _texts(RetrievalDataModule(workers), epoch=1) == full
    # resumed mid-epoch: the batches that were left, with the same views
    dm = RetrievalDataModule(cfg)
    dm.load_state_dict({"epoch": 1, "batches_done": 3})
    assert [(b["index"].tolist(), b["query"]["texts"], b["doc"]["texts"], b["doc_id"].tolist())
            for b in dm.train_dataloader()] == full[3:]
    other_seed = DataConfig(**{**cfg.__dict__, "seed": 1})
    assert _texts(RetrievalDataModule(other_seed), epoch=1) != full


def test_two_ranks_draw_other_rows_and_other_views(tmp_path):
    cfg = _cfg(tmp_path)
    ranks = [_texts(RetrievalDataModule(cfg, rank=r, world_size=2)) for r in (0, 1)]
    rows = [{i for b in r for i in b[0]} for r in ranks]
    assert rows[0] and rows[1] and not rows[0] & rows[1]
    views = [{v for b in r for v in b[1] + b[2]} for r in ranks]
    assert not views[0] & views[1]


def test_a_row_drawn_twice_in_an_epoch_gets_new_views(tmp_path):
    """A small source takes a second pass within one epoch (weighted sources): other views."""
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"query": f"q {i}", "positive": f"p {i}"} for i in range(64)])
    docs = write_jsonl(tmp_path / "docs.jsonl", _docs(8))
    cfg = DataConfig(kind="jsonl", eval_dir=str(write_eval(tmp_path / "eval")), batch_size=4, cache_dir=str(tmp_path / "c"),
                     sources=[SourceConfig(name="pairs", train_path=str(pairs), weight=1.0),
                              SourceConfig(name="docs", kind="documents", path=str(docs), weight=1.0)])
    seen: dict[int, list[str]] = {}
    for rows, queries, _, _ in _texts(RetrievalDataModule(cfg)):
        for r, q in zip(rows, queries):
            if r >= 64:
                seen.setdefault(r, []).append(q)
    twice = [v for v in seen.values() if len(v) > 1]
    assert twice and all(len(set(v)) == len(v) for v in twice)


# ----------------------------------------------------------------------------- ids and masking


@pytest.mark.parametrize("objective", ["moco", "two_queue", "inbatch"])
def test_both_views_keep_the_documents_id_and_the_queue_masks_its_earlier_views(tmp_path, tiny_dir, objective):
    """Epoch 0 queues a key of every document; in epoch 1 each query meets its own document's
    earlier view in the queue, masked by id (1 per query), never trained on as a negative. In-batch
    negatives, without a queue, meet no sibling view (an id is in a batch once)."""
    from moco_retrieval.objectives.inbatch import InBatchConfig
    from moco_retrieval.objectives.moco import MoCoConfig
    from moco_retrieval.objectives.two_queue import TwoQueueConfig
    from tests.helpers import make_module, quiet_trainer

    docs = _docs(16)
    cfg = _cfg(tmp_path, docs, eval_dir=str(write_eval(tmp_path / "eval")), shuffle=True)
    objectives = {"moco": MoCoConfig(queue_size=64, temperature=0.1, momentum=0.9),
                  "two_queue": TwoQueueConfig(queue_size=64, temperature=0.1, momentum=0.9),
                  "inbatch": InBatchConfig(temperature=0.1)}
    module = make_module(tiny_dir, objectives[objective])
    dm = RetrievalDataModule(cfg, tokenize=module.encoder.tokenize)
    ids = {p.doc_id for p in dm.train_rows.pairs()}
    assert ids == {stable_id(d["id"]) for d in docs}
    for b in _texts(dm):
        assert set(b[3]) <= ids and len(set(b[3])) == len(b[3])

    masked = []

    class Record(__import__("lightning").Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            masked.append((trainer.current_epoch, float(trainer.callback_metrics["train/masked_by_id"])))

    trainer = quiet_trainer(tmp_path / "fit", max_epochs=2, log_every_n_steps=1, callbacks=[Record()],
                            use_distributed_sampler=False)
    trainer.fit(module, datamodule=dm)
    assert [m for e, m in masked if e == 0][0] == 0.0
    assert [m for e, m in masked if e == 1] == [0.0 if objective == "inbatch" else 1.0] * 4


def test_one_source_of_documents_beside_pairs(tmp_path):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"query": f"q {i}", "positive": f"p {i}"} for i in range(16)])
    docs = write_jsonl(tmp_path / "docs.jsonl", _docs(16))
    cfg = DataConfig(kind="jsonl", eval_dir=str(write_eval(tmp_path / "eval")), batch_size=4, cache_dir=str(tmp_path / "c"),
                     sources=[SourceConfig(name="pairs", train_path=str(pairs)),
                              SourceConfig(name="docs", kind="documents", path=str(docs),
                                           views=ViewsConfig(pairs="title", deletion=0.0))])
    batches = _texts(RetrievalDataModule(cfg))
    kinds = {"pairs": 0, "docs": 0}
    for rows, queries, documents, _ in batches:
        if rows[0] < 16:
            kinds["pairs"] += 1
            assert all(q == f"q {r}" for r, q in zip(rows, queries))
        else:
            kinds["docs"] += 1
            assert all(re.fullmatch(r"title \d+", q) for q in queries)
            assert all(d.startswith("first sentence of") for d in documents)
    assert kinds == {"pairs": 4, "docs": 4}


# ---------------------------------------------------------------------------------- validation


def test_without_eval_dir_held_out_documents_validate_and_never_train(tmp_path):
    cfg = _cfg(tmp_path, _docs(60))
    dm = RetrievalDataModule(cfg)
    dm.setup("fit")
    keep = held_out(60, cfg.seed)
    assert len(keep) == 6 and HELD_OUT_MAX == 1000
    train_ids = {p.doc_id for p in dm.train_rows.pairs()}
    held_ids = {stable_id(f"doc{r}") for r in keep}
    assert len(train_ids) == 54 and not train_ids & held_ids
    ev = dm.eval_set
    assert len(ev.queries) == len(ev.corpus) == 6
    for q, rel in ev.qrels.items():
        (d,) = rel
        assert set(ev.queries[q].split()) <= set(ev.corpus[d].split())
    assert RetrievalDataModule(cfg).eval_set.queries == ev.queries  # fixed crops
    (tmp_path / "few").mkdir()
    with pytest.raises(DataError, match="give at least 10 documents, or data.eval_dir"):
        RetrievalDataModule(_cfg(tmp_path / "few", _docs(5))).setup("fit")


def test_a_resume_that_changes_the_documents_or_their_views_is_refused(tmp_path):
    from moco_retrieval.errors import CheckpointError
    from moco_retrieval.training.resume_check import TRAINED_WITH, check_resumable, recorded_options
    from tests.helpers import compose_cfg

    docs = write_jsonl(tmp_path / "docs.jsonl", _docs(20))
    cfg = lambda *o: compose_cfg("train", ["data=documents", f"data.path={docs}", *o], to_object=True)  # noqa: E731
    ckpt = {"hyper_parameters": {}, TRAINED_WITH: recorded_options(cfg())}
    check_resumable(ckpt, "last.ckpt", cfg())  # as trained: accepted
    with pytest.raises(CheckpointError, match=r"trained with data\.views\.deletion=0\.1, but this run's config has "
                                              r"data\.views\.deletion=0\.2"):
        check_resumable(ckpt, "last.ckpt", cfg("data.views.deletion=0.2"))
    with pytest.raises(CheckpointError, match=r"trained with data\.path="):
        check_resumable(ckpt, "last.ckpt", cfg(f"data.path={tmp_path / 'other.jsonl'}"))
