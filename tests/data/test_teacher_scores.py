"""Teacher scores in the data (issue 47, part 1): ``positive_score`` and ``negative_scores`` in every
input kind, stored and memory-mapped, their errors located, the batch's ``pos_score`` / ``neg_score``,
and a distilling run refused when a row lacks them."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from moco_retrieval.data.datamodule import RetrievalDataModule
from moco_retrieval.data.formats import DataError, read_pairs_jsonl
from moco_retrieval.data.hf_folder import read_hf_pairs_located
from moco_retrieval.data.tabular import read_pairs_csv_located, read_pairs_parquet_located
from tests.helpers import make_cfg, write_jsonl

ROWS = [
    {"query": "resize images", "positive": "ImageMagick edits images.", "positive_score": 9.5,
     "negatives": ["GIMP paints.", "Inkscape draws."], "negative_scores": [4.0, -1.5]},
    {"query": "play chess", "positive": "GNOME chess.", "positive_score": 3,
     "negatives": [{"text": "Stockfish thinks.", "score": 2.5}]},
]


def scores(pairs):
    return [(p.positive_score, [n.score for n in p.negatives]) for p in pairs]


WANT = [(9.5, [4.0, -1.5]), (3.0, [2.5])]


def test_jsonl_negative_scores_are_the_negatives_scores(tmp_path):
    pairs = read_pairs_jsonl(write_jsonl(tmp_path / "p.jsonl", ROWS))
    assert scores(pairs) == WANT
    assert [p.scored for p in pairs] == [True, True]


def test_csv_parquet_and_datasets_folders_read_negative_scores(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [dict(ROWS[0]), {"query": "play chess", "positive": "GNOME chess.", "positive_score": 3.0,
                            "negatives": ["Stockfish thinks."], "negative_scores": [2.5]}]
    csv_path = tmp_path / "p.csv"
    csv_path.write_text("query,positive,positive_score,negatives,negative_scores\n" + "".join(
        f"{r['query']},{r['positive']},{r['positive_score']},\"{json.dumps(r['negatives']).replace(chr(34), chr(34) * 2)}\","
        f"\"{json.dumps(r['negative_scores'])}\"\n" for r in rows))
    assert scores(p for _, p in read_pairs_csv_located(csv_path)) == WANT
    table = pa.table({k: [r[k] for r in rows] for k in rows[0]})
    pq.write_table(table, tmp_path / "p.parquet")
    assert scores(p for _, p in read_pairs_parquet_located(tmp_path / "p.parquet")) == WANT
    (tmp_path / "hf").mkdir()
    pq.write_table(table, tmp_path / "hf" / "train-0.parquet")
    assert scores(p for _, _, p in read_hf_pairs_located(tmp_path / "hf", "train")) == WANT
    # sentence-transformers' negative columns take their scores from negative_scores too
    st = pa.table({"anchor": ["q"], "positive": ["d"], "negative": ["n0"], "negative_1": ["n1"],
                   "positive_score": [1.0], "negative_scores": [[0.5, 0.25]]})
    pq.write_table(st, tmp_path / "st.parquet")
    assert scores(p for _, p in read_pairs_parquet_located(tmp_path / "st.parquet")) == [(1.0, [0.5, 0.25])]


@pytest.mark.parametrize("row, says", [
    ({"negative_scores": [1.0]}, "field 'negative_scores' holds 1 scores for 2 hard negatives; expected one score per negative"),
    ({"negatives": None}, "field 'negative_scores' holds 2 scores for 0 hard negatives"),
    ({"negative_scores": [1.0, float("nan")]}, "field 'negative_scores': score 1 is nan; expected a finite number"),
    ({"negative_scores": [1.0, "high"]}, "field 'negative_scores': score 1 is a string; expected a finite number"),
    ({"negative_scores": 1.0}, "field 'negative_scores' must be a list of numbers, got a number"),
    ({"positive_score": float("inf")}, "field 'positive_score' is inf; expected a finite number"),
    ({"negatives": [{"text": "a", "score": 1.0}, "b"]}, "field 'negative_scores' and a negative's own 'score' both given"),
])
def test_bad_teacher_scores_are_located(tmp_path, row, says):
    path = tmp_path / "p.jsonl"
    # json.dumps writes NaN and Infinity, which json reads back (the reader refuses them)
    path.write_text(json.dumps(ROWS[1]) + "\n" + json.dumps({**ROWS[0], **row}) + "\n")
    with pytest.raises(DataError, match=re.escape(f"{path}:2: {says}")):
        read_pairs_jsonl(path)


def test_a_negatives_own_nan_score_names_it(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"query": "q", "positive": "d", "negatives": [{"text": "a", "score": float("nan")}]}) + "\n")
    with pytest.raises(DataError, match=re.escape(f"{path}:1: field 'negatives[0].score' is nan; expected a finite number")):
        read_pairs_jsonl(path)


def test_csv_bad_negative_scores_name_the_column(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text('query,positive,negatives,scores\nq,d,"[""a"", ""b""]","[1.0]"\n')
    from moco_retrieval.config import ColumnsConfig

    with pytest.raises(DataError, match=re.escape(f"{path}: row 2, column 'scores': field 'negative_scores' holds 1 scores")):
        read_pairs_csv_located(path, ColumnsConfig(negative_scores="scores"))
    path.write_text('query,positive,negative_scores\nq,d,"[1.0,"\n')
    with pytest.raises(DataError, match=re.escape(f"{path}: row 2, column 'negative_scores': expected a JSON list of numbers")):
        read_pairs_csv_located(path)


def scored_rows(i):
    """Row i's negatives with scores, except row 3's second negative."""
    return [{"text": f"neg {i} {j}", "score": float(j) if (i, j) != (3, 1) else None} for j in range(2)]


def test_the_store_keeps_the_scores_and_the_batch_carries_them(tmp_path):
    cfg = make_cfg(tmp_path, n=8, negatives=lambda i: [{"text": f"neg {i} {j}", "score": i + j / 10} for j in range(2)])
    rows = [json.loads(line) for line in open(cfg.train_path)]
    write_jsonl(Path(cfg.train_path), [dict(r, positive_score=float(10 + k)) for k, r in enumerate(rows)])
    dm = RetrievalDataModule(cfg, n_negatives=3, teacher_scores=True)
    dm.setup("fit")
    assert dm.store_dir is not None and np.load(dm.store_dir / "scored.npy").all()
    batch = next(iter(dm.train_dataloader()))
    index = batch["index"].tolist()
    assert torch.equal(batch["pos_score"], torch.tensor([10.0 + i for i in index]))
    # 3 per row from 2: the padding repeats a negative with its score
    for r, i in enumerate(index):
        neg = batch["neg_score"][3 * r : 3 * r + 3].tolist()
        texts = batch["neg"]["texts"][3 * r : 3 * r + 3]
        assert neg == pytest.approx([i + int(t.split()[-1]) / 10 for t in texts])


def test_a_distilling_run_refuses_rows_without_scores_naming_the_first(tmp_path):
    cfg = make_cfg(tmp_path, n=6, negatives=scored_rows)
    rows = [json.loads(line) for line in open(cfg.train_path)]
    write_jsonl(Path(cfg.train_path), [dict(r, positive_score=1.0) for r in rows])
    RetrievalDataModule(cfg, n_negatives=2).setup("fit")  # without distillation the scores are not needed
    with pytest.raises(DataError, match=re.escape(
            f"{cfg.train_path}:4: training example 3, query_id 'q3' (query 'query 3') has no teacher scores "
            "(1 of 6 rows lack them), but objective.distill trains on them")):
        RetrievalDataModule(cfg, n_negatives=2, teacher_scores=True).setup("fit")
