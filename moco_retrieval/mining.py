"""Hard-negative mining with false-negative filters (``python -m moco_retrieval.mine``).

For every training pair the query is searched against a corpus and the best-ranked documents
that are *not* known to be relevant become its hard negatives:

1. The corpus is the training documents: the pairs' positives, one entry per document id.
2. Corpus and queries are encoded by one model (a checkpoint, an exported model directory or
   the base encoder) and each query's top candidates are found with FAISS (inner product: the
   training score; cosine for a normalizing model).
3. Candidates are removed, in this order (each candidate is counted under the first rule that
   removes it; ``stats["removed"]``):

   * ``positive``: a positive of the query: the pair's own document, and every document paired
     with the same query text elsewhere in the data. Always removed: a positive is never a negative.
   * ``group``: a document of the same group as one of those positives (``drop_group``, default
     on): known duplicates (the Debian set: binary packages of one source package).
   * ``rank_window``: ranks are 0-based and counted over the candidates left after the two rules
     above (rank 0 = the best-scoring document that is neither a positive nor in its group); a
     candidate is kept only when ``range_min <= rank <= range_max``. The search goes deep enough
     that every query has ``range_max + 1`` ranked candidates after the removals (when the corpus
     has them); candidates below ``range_min`` are counted as removed, the list ends at
     ``range_max``.
   * ``margin`` (absolute): keep only if ``score(neg) <= score(pos) - margin``.
   * ``relative_margin``: keep only if ``score(neg) <= score(pos) * (1 - r)``; r = 0.05 by default.
     Positive-aware mining ("TopK-PercPos", Moreira et al. 2024, "NV-Retriever"): a candidate that
     scores nearly as high as the labelled positive is likely an unlabelled relevant document,
     and training against it teaches the model to push relevant documents away. ``null`` turns
     it off; ``0`` still removes candidates scoring above the positive. (Meant for positive
     scores, e.g. cosine > 0; with a negative positive score the bound lies above it.)
   * ``max_score``: keep only if ``score(neg) <= max_score``.

   ``stats["would_remove_alone"]`` also says how many candidates of the window each score filter
   rejects by itself (the filters overlap).
4. ``n_negatives`` of the candidates that pass are kept per query: the best-ranked (``sampling=top``)
   or a uniform random choice (``sampling=random``, generator seeded by ``(seed, row)``), listed
   by rank.

The output is the training JSONL of :mod:`moco_retrieval.data.formats` (read by
``read_pairs_jsonl``; train with ``data=jsonl data.train_path=OUT data.n_negatives=N``): each row
keeps its query, positive, ids and group, gains ``positive_score`` and ``negatives`` (``doc_id``,
``text``, ``score``, ``group`` when known, and ``rank``), replacing any negatives it had; ids and
groups are written as the data gave them (a string ``"d9"`` stays ``"d9"``). Rows left without a
negative are not written unless ``keep_empty`` (training with ``n_negatives`` refuses them); a
warning says how many, what removed their candidates, and the printed training command says what
part of the pairs it trains on. The statistics go to ``<output stem>.stats.json`` and to stdout.

The output is refused before anything is read when it is a directory, exists (unless
``overwrite=true``) or is one of the command's inputs (the training pairs, the evaluation or BEIR
folder's files, the checkpoint, the model folders; ``overwrite=true`` or not: outputs.py), and it is
written atomically (a temporary file renamed over it once complete).
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from moco_retrieval.data.formats import Negative, Pair, pair_to_json, write_jsonl
from moco_retrieval.data.ids import NO_GROUP, normalize_text
from moco_retrieval.errors import ConfigError

SAMPLINGS = ("top", "random")
REMOVAL_REASONS = ("positive", "group", "rank_window", "margin", "relative_margin", "max_score")
SCORE_FILTERS = ("margin", "relative_margin", "max_score")


# ----------------------------------------------------------------------------------- filters


@dataclass
class MiningFilters:
    """What a candidate must satisfy to become a negative (see the module docstring)."""

    range_min: int = 0
    range_max: int = 50
    margin: Optional[float] = None
    relative_margin: Optional[float] = 0.05
    max_score: Optional[float] = None
    drop_group: bool = True

    def check(self) -> "MiningFilters":
        for name in SCORE_FILTERS:
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ConfigError(f"{name}={value}: expected a finite number (or null: no such filter)")
        if self.range_min < 0 or self.range_max < self.range_min:
            raise ConfigError(
                f"rank window [range_min={self.range_min}, range_max={self.range_max}]: expected "
                "0 <= range_min <= range_max"
            )
        if self.margin is not None and self.margin < 0:
            raise ConfigError(f"margin={self.margin}: expected >= 0 (or null for no absolute margin)")
        if self.relative_margin is not None and not 0 <= self.relative_margin < 1:
            raise ConfigError(f"relative_margin={self.relative_margin}: expected 0 <= r < 1 (or null)")
        return self

    def score_rejects(self, score: float, pos_score: float) -> Optional[str]:
        """The first score filter that rejects ``score`` (None: it passes)."""
        for name in SCORE_FILTERS:
            if self._rejects(name, score, pos_score):
                return name
        return None

    def _rejects(self, name: str, score: float, pos_score: float) -> bool:
        if name == "margin":
            return self.margin is not None and not score <= pos_score - self.margin
        if name == "relative_margin":
            return self.relative_margin is not None and not score <= pos_score * (1 - self.relative_margin)
        if name == "max_score":
            return self.max_score is not None and not score <= self.max_score
        raise KeyError(name)


@dataclass
class Candidate:
    doc: int  # corpus position
    score: float
    rank: int  # 0-based rank after removing positives and their groups


def add_counts(total: dict[str, Any], part: dict[str, Any]) -> None:
    """``total += part``, key by key (nested dicts of counts, as :func:`new_counts` makes)."""
    for key, value in part.items():
        if isinstance(value, dict):
            add_counts(total[key], value)
        else:
            total[key] += value


def new_counts() -> dict[str, Any]:
    return {
        "considered": 0,
        "removed": {r: 0 for r in REMOVAL_REASONS},
        "would_remove_alone": {r: 0 for r in SCORE_FILTERS},
        "passed": 0,
        "not_sampled": 0,
        "kept": 0,
    }


def filter_candidates(
    docs: Sequence[int],
    scores: Sequence[float],
    pos_score: float,
    positives: set[int],
    positive_groups: set[int],
    doc_groups: Sequence[int],
    filters: MiningFilters,
    counts: Optional[dict] = None,
) -> list[Candidate]:
    """The candidates of one query that pass every filter, in rank order.

    ``docs``/``scores``: the query's search results, best first (corpus positions; -1 = no result).
    ``positives``: corpus positions of the query's positives; ``positive_groups``: their groups
    (>= 0). ``doc_groups[j]``: group of corpus document j (-1 none). ``counts`` (from
    :func:`new_counts`) is updated in place.
    """
    counts = counts if counts is not None else new_counts()
    out: list[Candidate] = []
    rank = -1
    for j, s in zip(docs, scores):
        j = int(j)
        if j < 0:
            continue
        if rank >= filters.range_max:
            break  # the window is complete
        s = float(s)
        counts["considered"] += 1
        if j in positives:
            counts["removed"]["positive"] += 1
            continue
        if filters.drop_group and doc_groups[j] != NO_GROUP and doc_groups[j] in positive_groups:
            counts["removed"]["group"] += 1
            continue
        rank += 1
        if rank < filters.range_min:
            counts["removed"]["rank_window"] += 1
            continue
        for name in SCORE_FILTERS:
            if filters._rejects(name, s, pos_score):
                counts["would_remove_alone"][name] += 1
        reason = filters.score_rejects(s, pos_score)
        if reason is not None:
            counts["removed"][reason] += 1
            continue
        counts["passed"] += 1
        out.append(Candidate(j, s, rank))
    return out


def sample_candidates(passing: list[Candidate], n: int, sampling: str, seed: int, row: int) -> list[Candidate]:
    """``n`` of the passing candidates: the best-ranked, or a seeded uniform choice (rank order kept)."""
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling={sampling!r}: expected one of {SAMPLINGS}")
    if len(passing) <= n:
        return list(passing)
    if sampling == "top":
        return passing[:n]
    rng = np.random.default_rng([int(seed), int(row)])
    pick = sorted(rng.choice(len(passing), size=n, replace=False).tolist())
    return [passing[i] for i in pick]


# ------------------------------------------------------------------------------------ corpus


@dataclass
class Corpus:
    """The training documents: one entry per positive document id (first text and group seen)."""

    doc_ids: list[int]
    texts: list[str]
    groups: list[int]
    row_doc: list[int]  # corpus position of each pair's positive
    row_positives: list[set[int]]  # corpus positions of every positive of each pair's query
    row_groups: list[set[int]]  # groups (>= 0) of those positives
    given_doc_ids: list[Any] = field(default_factory=list)  # each document's id and group as the data gave them
    given_groups: list[Any] = field(default_factory=list)  # (None: not given), written as such into negatives

    def __len__(self) -> int:
        return len(self.doc_ids)

    def negative(self, c: "Candidate") -> Negative:
        j = c.doc
        return Negative(doc_id=self.doc_ids[j], text=self.texts[j], score=round(c.score, 6), group=self.groups[j],
                        given_doc_id=self.given_doc_ids[j], given_group=self.given_groups[j])


def build_corpus(pairs: Sequence[Pair]) -> Corpus:
    """The corpus of ``pairs`` and, per pair, what must never be its negative."""
    pos_of: dict[int, int] = {}
    doc_ids: list[int] = []
    texts: list[str] = []
    groups: list[int] = []
    row_doc: list[int] = []
    given_ids: list[Any] = []
    given_groups: list[Any] = []
    for p in pairs:
        j = pos_of.get(p.doc_id)
        if j is None:
            j = pos_of[p.doc_id] = len(doc_ids)
            doc_ids.append(int(p.doc_id))
            texts.append(p.positive)
            groups.append(int(p.group))
            given_ids.append(p.given_doc_id)
            given_groups.append(p.given_group)
        elif groups[j] == NO_GROUP and p.group != NO_GROUP:
            groups[j] = int(p.group)
            given_groups[j] = p.given_group
        row_doc.append(j)
    by_query: dict[str, set[int]] = {}
    for p, j in zip(pairs, row_doc):
        by_query.setdefault(normalize_text(p.query).casefold(), set()).add(j)
    row_positives, row_groups = [], []
    for p, j in zip(pairs, row_doc):
        pos = by_query[normalize_text(p.query).casefold()]
        row_positives.append(pos)
        g = {groups[k] for k in pos if groups[k] != NO_GROUP}
        if p.group != NO_GROUP:
            g.add(int(p.group))
        row_groups.append(g)
    return Corpus(doc_ids, texts, groups, row_doc, row_positives, row_groups, given_ids, given_groups)


# ------------------------------------------------------------------------------------ mining


@dataclass
class MiningResult:
    pairs: list[Pair]  # the rows to write (with their mined negatives)
    ranks: list[list[int]]  # per written row, the rank of each negative
    stats: dict[str, Any]


def _excluded_count(corpus: Corpus, row: int, group_size: dict[int, int], drop_group: bool) -> int:
    n = len(corpus.row_positives[row])
    if drop_group:
        n += sum(group_size.get(g, 0) for g in corpus.row_groups[row])
    return n


def _search_all(index, q_emb: np.ndarray, rows: list[int], k: int, progress: bool, desc: str, chunk: int = 1024):
    from moco_retrieval.evaluation.index import search

    scores = np.empty((len(rows), k), np.float32)
    idx = np.empty((len(rows), k), np.int64)
    bar = None
    if progress:
        from moco_retrieval.progress import progress_bar

        bar = progress_bar(len(rows), desc, " queries")
    try:
        for s in range(0, len(rows), chunk):
            sl = rows[s : s + chunk]
            sc, ix = search(index, q_emb[sl], k)
            scores[s : s + len(sl), : sc.shape[1]] = sc
            idx[s : s + len(sl), : ix.shape[1]] = ix
            if sc.shape[1] < k:
                idx[s : s + len(sl), sc.shape[1] :] = -1
            if bar is not None:
                bar.update(len(sl))
    finally:
        if bar is not None:
            bar.close()
    return scores, idx


def mine_from_embeddings(
    pairs: Sequence[Pair],
    corpus: Corpus,
    q_emb: np.ndarray,
    d_emb: np.ndarray,
    filters: MiningFilters,
    *,
    n_negatives: int = 8,
    sampling: str = "top",
    seed: int = 0,
    keep_empty: bool = False,
    index_cfg: Any = None,
    progress: bool = True,
) -> MiningResult:
    """Mine with given embeddings: ``q_emb[i]`` of ``pairs[i].query``, ``d_emb[j]`` of ``corpus.texts[j]``."""
    from moco_retrieval.config import EvalConfig
    from moco_retrieval.evaluation.index import build_index_from_config

    filters.check()
    if n_negatives < 1:
        raise ValueError(f"n_negatives={n_negatives}: expected >= 1")
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling={sampling!r}: expected one of {SAMPLINGS}")
    q_emb = np.ascontiguousarray(q_emb, dtype=np.float32)
    d_emb = np.ascontiguousarray(d_emb, dtype=np.float32)
    if len(q_emb) != len(pairs) or len(d_emb) != len(corpus):
        raise ValueError(f"{len(q_emb)} query vectors for {len(pairs)} pairs, {len(d_emb)} document vectors for {len(corpus)} documents")
    index_cfg = index_cfg or EvalConfig()
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    index = build_index_from_config(d_emb, index_cfg)
    timings["index"] = time.perf_counter() - t0

    # search depth: the window plus whatever a row must skip (its positives and their groups)
    group_size: dict[int, int] = {}
    for g in corpus.groups:
        if g != NO_GROUP:
            group_size[g] = group_size.get(g, 0) + 1
    need = [filters.range_max + 1 + _excluded_count(corpus, i, group_size, filters.drop_group) for i in range(len(pairs))]
    base_k = min(len(corpus), filters.range_max + 1 + 16)
    deeper = base_k < len(corpus)
    rows_small = [i for i in range(len(pairs)) if not deeper or need[i] <= base_k]
    rows_large = [i for i in range(len(pairs)) if deeper and need[i] > base_k]
    t0 = time.perf_counter()
    results: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for rows, k, desc in [
        (rows_small, base_k, "searching"),
        (rows_large, min(len(corpus), max((need[i] for i in rows_large), default=0)), "searching (large groups)"),
    ]:
        if not rows:
            continue
        sc, ix = _search_all(index, q_emb, rows, k, progress, desc)
        for r, i in enumerate(rows):
            results[i] = (sc[r], ix[r])
    timings["search"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    counts = new_counts()
    empty_removed = {"considered": 0, **{r: 0 for r in REMOVAL_REASONS}}
    out_pairs: list[Pair] = []
    out_ranks: list[list[int]] = []
    n_hist = {"full": 0, "short": 0, "empty": 0}
    pos_scores, neg_scores, neg_ranks = [], [], []
    bar = None
    if progress:
        from moco_retrieval.progress import progress_bar

        bar = progress_bar(len(pairs), "filtering", " queries")
    for i, p in enumerate(pairs):
        pos_score = float(q_emb[i] @ d_emb[corpus.row_doc[i]])
        sc, ix = results[i]
        row_counts = new_counts()
        passing = filter_candidates(
            ix.tolist(), sc.tolist(), pos_score, corpus.row_positives[i], corpus.row_groups[i], corpus.groups, filters,
            row_counts,
        )
        add_counts(counts, row_counts)
        if not passing:  # why this row gets no negative: what removed its candidates
            add_counts(empty_removed, row_counts["removed"])
            empty_removed["considered"] += row_counts["considered"]
        chosen = sample_candidates(passing, n_negatives, sampling, seed, i)
        counts["not_sampled"] += len(passing) - len(chosen)
        counts["kept"] += len(chosen)
        n_hist["full" if len(chosen) >= n_negatives else "short" if chosen else "empty"] += 1
        pos_scores.append(pos_score)
        if chosen or keep_empty:  # (replace: the pair's ids stay as the data gave them)
            out_pairs.append(replace(p, negatives=[corpus.negative(c) for c in chosen], positive_score=round(pos_score, 6)))
            out_ranks.append([c.rank for c in chosen])
            neg_scores.extend(c.score for c in chosen)
            neg_ranks.extend(c.rank for c in chosen)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    timings["filter"] = time.perf_counter() - t0

    def _mean(xs):
        return float(np.mean(xs)) if len(xs) else math.nan

    stats = {
        "queries": len(pairs),
        "corpus_documents": len(corpus),
        "search_depth": {"k": base_k, "queries_searched_deeper": len(rows_large)},
        "candidates": counts,
        "queries_with_n_negatives": n_hist["full"],
        "queries_with_fewer": n_hist["short"],
        "queries_without_negatives": n_hist["empty"],
        # the rows without a negative: how many candidates they had, and what removed them
        "candidates_of_queries_without_negatives": empty_removed,
        "rows_written": len(out_pairs),
        "negatives_written": counts["kept"],
        "mean_positive_score": _mean(pos_scores),
        "mean_negative_score": _mean(neg_scores),
        "mean_negative_rank": _mean(neg_ranks),
        "settings": {**asdict(filters), "n_negatives": n_negatives, "sampling": sampling, "seed": seed,
                     "keep_empty": keep_empty, "index": getattr(index_cfg, "index", "flat")},
        "timings": timings,
    }
    return MiningResult(out_pairs, out_ranks, stats)


def mine_hard_negatives(
    encoder: Any,
    pairs: Sequence[Pair],
    filters: MiningFilters,
    *,
    n_negatives: int = 8,
    sampling: str = "top",
    seed: int = 0,
    keep_empty: bool = False,
    index_cfg: Any = None,
    batch_size: int = 256,
    progress: bool = True,
) -> MiningResult:
    """Encode the corpus of ``pairs`` (their positives) and their queries with ``encoder`` (a
    ``TextEncoder``, or any ``encoder(side, kind)`` module) and mine (see the module docstring)."""
    from moco_retrieval.evaluation.encode import encode_texts_sharded as encode_texts  # 1/N per rank under a process group

    if not pairs:
        raise ValueError("no training pairs to mine for")
    corpus = build_corpus(pairs)
    t0 = time.perf_counter()
    d_emb = encode_texts(encoder, corpus.texts, "doc", batch_size, progress, description=f"encoding {len(corpus):,} documents")
    t_docs = time.perf_counter() - t0
    t0 = time.perf_counter()
    q_emb = encode_texts(encoder, [p.query for p in pairs], "query", batch_size, progress, description=f"encoding {len(pairs):,} queries")
    t_queries = time.perf_counter() - t0
    res = mine_from_embeddings(
        pairs, corpus, q_emb, d_emb, filters, n_negatives=n_negatives, sampling=sampling, seed=seed,
        keep_empty=keep_empty, index_cfg=index_cfg, progress=progress,
    )
    res.stats["timings"] = {"encode_docs": t_docs, "encode_queries": t_queries, **res.stats["timings"]}
    return res


# ------------------------------------------------------------------------------------ output


def write_mined(path: str | Path, result: MiningResult) -> int:
    """The training JSONL (see the module docstring); returns the number of rows."""
    def records():
        for pair, ranks in zip(result.pairs, result.ranks):
            obj = pair_to_json(pair)
            for neg, r in zip(obj.get("negatives", []), ranks):
                neg["rank"] = r
            yield obj

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_jsonl(path, records())


def stats_path_for(output: str | Path) -> Path:
    p = Path(output)
    stem = p.name[: -len(".jsonl")] if p.name.endswith(".jsonl") else p.name
    return p.with_name(stem + ".stats.json")


def format_stats(stats: dict) -> str:
    c = stats["candidates"]
    lines = [
        f"mined {stats['negatives_written']:,} negatives for {stats['rows_written']:,} of {stats['queries']:,} queries "
        f"(corpus {stats['corpus_documents']:,} documents)",
        f"  candidates considered: {c['considered']:,}",
    ]
    for r in REMOVAL_REASONS:
        alone = f" (alone: {c['would_remove_alone'][r]:,})" if r in SCORE_FILTERS else ""
        lines.append(f"  removed by {r:<16} {c['removed'][r]:>10,}{alone}")
    lines += [
        f"  passed all filters:        {c['passed']:>10,}  (kept {c['kept']:,}, not sampled {c['not_sampled']:,})",
        f"  queries with {stats['settings']['n_negatives']} negatives: {stats['queries_with_n_negatives']:,}, "
        f"with fewer: {stats['queries_with_fewer']:,}, with none: {stats['queries_without_negatives']:,}",
        f"  mean score: positive {stats['mean_positive_score']:.4f}, negatives {stats['mean_negative_score']:.4f} "
        f"(mean rank {stats['mean_negative_rank']:.1f})",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ command


def load_training_pairs(data_cfg: Any) -> list[Pair]:
    """The training pairs of a DataConfig (capped as in training); ``kind=jsonl`` needs only ``train_path`` here."""
    from moco_retrieval.data.sources import load_training_pairs as load_pairs

    return load_pairs(data_cfg).pairs


def eval_dir_of(data_cfg: Any) -> str:
    """The BEIR folder to validate on after mining: the built Debian set's eval/ folder, the data
    config's eval_dir, else the placeholder DIR."""
    if data_cfg.kind == "debian":
        from moco_retrieval.data.sources import debian_folder

        return str(debian_folder(data_cfg) / "eval")
    if data_cfg.kind == "beir" and getattr(data_cfg, "dir", None):
        return str(data_cfg.dir)  # its qrels/<eval_split>.tsv: also set data.eval_split
    return str(getattr(data_cfg, "eval_dir", None) or "DIR")


def mining_inputs(cfg: Any) -> dict[str, list[Path]]:
    """What ``mine`` reads, by the key that names it: the output is never one of these files."""
    from moco_retrieval.outputs import files_under

    data = cfg.data
    inputs = {f"data.{key}": files_under(getattr(data, key, None)) for key in ("train_path", "eval_dir", "dir", "debian_dir")}
    for i, source in enumerate(getattr(data, "sources", None) or []):  # (several training sources, where configured)
        for key in ("train_path", "dir"):
            inputs[f"data.sources[{i}].{key}"] = files_under(getattr(source, key, None))
    if data.kind == "debian":
        from moco_retrieval.data.sources import debian_folder

        inputs["the built Debian data set"] = files_under(debian_folder(data))
    inputs.update({key: files_under(getattr(cfg, key, None)) for key in ("checkpoint", "model_dir")})
    inputs["model.path"] = files_under(getattr(cfg.model, "path", None))
    return inputs


def check_mine_outputs(cfg: Any) -> tuple[Path, Path]:
    """``(output, stats file)``, refused (one message naming the key) before anything is read when
    either is a directory, there already without ``overwrite``, or an input (see outputs.py)."""
    from moco_retrieval.outputs import check_output

    if not cfg.output:
        raise ConfigError("output=FILE is required (the JSONL of pairs with mined negatives)")
    out = Path(cfg.output).expanduser()
    stats_file = Path(cfg.stats_path).expanduser() if cfg.stats_path else stats_path_for(out)
    check_output(out, "output", True, {})  # (a directory: said before the inputs are listed, a Debian set built)
    inputs = mining_inputs(cfg)
    check_output(out, "output", bool(cfg.overwrite), inputs)
    check_output(stats_file, "stats_path", bool(cfg.overwrite), {**inputs, "output": [out]})
    return out, stats_file


def dropped_rows_warning(stats: dict, out: Path, keep_empty: bool) -> Optional[str]:
    """What a user must know before training on ``out`` when rows got no negative: how many, why,
    and what is in the file (None: every row got one)."""
    n, total = stats["queries_without_negatives"], stats["queries"]
    if not n:
        return None
    why = stats["candidates_of_queries_without_negatives"]
    removed = sorted(((why[r], r) for r in REMOVAL_REASONS if why[r]), reverse=True)
    reasons = ", ".join(f"{r} {k:,}" for k, r in removed) or "none: the corpus has no other document"
    lines = [f"[moco_retrieval] warning: {n:,} of {total:,} training pairs ({100 * n / total:.1f}%) got no hard "
             f"negative: the filters removed every candidate they had ({why['considered']:,} candidates; removed "
             f"by {reasons})."]
    if keep_empty:
        lines.append(f"They are in {out} without negatives (keep_empty=true); training with data.n_negatives "
                     "refuses such rows.")
    else:
        written = stats["rows_written"]
        lines.append(f"They are left out: {out} holds {written:,} rows, {100 * written / total:.1f}% of the pairs. "
                     "keep_empty=true writes them too, without negatives.")
    lines.append("A weak model scores unrelated documents close to the positive: looser filters "
                 "(relative_margin=null, margin=null, range_min=0, a larger range_max) or a trained model "
                 "(checkpoint=...) leave more.")
    return " ".join(lines)


def next_command(stats: dict, out: Path, cfg: Any) -> str:
    """The training command for ``out``, saying what part of the pairs it trains on."""
    command = (f"data=jsonl data.train_path={out} data.eval_dir={eval_dir_of(cfg.data)} "
               f"data.n_negatives={cfg.n_negatives}")
    with_negatives, total = stats["queries"] - stats["queries_without_negatives"], stats["queries"]
    if with_negatives == total:
        return f"train with: {command}"
    if cfg.keep_empty:
        return (f"train with (data.n_negatives refuses the {total - with_negatives:,} rows written without negatives; "
                f"keep_empty=false leaves them out): {command}")
    return (f"train with (on {with_negatives:,} of your {total:,} training pairs, {100 * with_negatives / total:.1f}%: "
            f"only the rows that got negatives): {command}")


def run_mine(cfg: Any) -> MiningResult:
    """``python -m moco_retrieval.mine``: load the model and pairs, mine, write JSONL and stats."""
    from moco_retrieval.model.loading import load_encoder
    from moco_retrieval.outputs import atomic_write

    out, stats_file = check_mine_outputs(cfg)
    filters = MiningFilters(
        range_min=cfg.range_min, range_max=cfg.range_max, margin=cfg.margin, relative_margin=cfg.relative_margin,
        max_score=cfg.max_score, drop_group=cfg.drop_group,
    ).check()
    if cfg.sampling not in SAMPLINGS:
        raise ConfigError(f"sampling={cfg.sampling!r}: expected one of {', '.join(SAMPLINGS)}")
    pairs = load_training_pairs(cfg.data)
    encoder, desc = load_encoder(checkpoint=cfg.checkpoint, model_dir=cfg.model_dir, model=cfg.model, encoder=cfg.encoder,
                                 prompts=cfg.data.prompts)
    print(f"mining with {desc['source']} encoder ({desc.get('path', desc.get('backbone'))}, dim {encoder.dim}) "
          f"for {len(pairs):,} training pairs", file=sys.stderr)
    if encoder.frozen:
        encoder.warm_features(encoder.prompts.apply([p.query for p in pairs], "query"),
                              encoder.prompts.apply(build_corpus(pairs).texts, "doc"), progress=cfg.progress)
    else:
        from moco_retrieval.evaluation.forecast import announce_encoding

        announce_encoding(encoder, [(build_corpus(pairs).texts, "doc"), ([p.query for p in pairs], "query")],
                          f"the training pairs of data={cfg.data.kind}", cfg.batch_size,
                          "data.max_train_examples=N mines a seeded subset")
    result = mine_hard_negatives(
        encoder, pairs, filters, n_negatives=cfg.n_negatives, sampling=cfg.sampling, seed=cfg.seed,
        keep_empty=cfg.keep_empty, index_cfg=cfg.eval, batch_size=cfg.batch_size, progress=cfg.progress,
    )
    result.stats["model"] = desc
    result.stats["output"] = str(out)
    with atomic_write(out) as tmp:
        write_mined(tmp, result)
    with atomic_write(stats_file) as tmp:
        tmp.write_text(json.dumps(result.stats, indent=2, default=str) + "\n", encoding="utf-8")
    print(format_stats(result.stats))
    print(f"wrote {out} and {stats_file}")
    warning = dropped_rows_warning(result.stats, out, bool(cfg.keep_empty))
    if warning:
        from moco_retrieval.errors import wrap_message

        print(wrap_message(warning), file=sys.stderr, flush=True)
    print(next_command(result.stats, out, cfg))
    return result


__all__ = [
    "MiningFilters",
    "Candidate",
    "Corpus",
    "MiningResult",
    "REMOVAL_REASONS",
    "build_corpus",
    "filter_candidates",
    "sample_candidates",
    "mine_from_embeddings",
    "mine_hard_negatives",
    "write_mined",
    "stats_path_for",
    "format_stats",
    "load_training_pairs",
    "check_mine_outputs",
    "dropped_rows_warning",
    "run_mine",
]
