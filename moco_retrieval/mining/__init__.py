"""Hard-negative mining with false-negative filters (the command: ``python -m moco_retrieval.mine``).

For every training pair the query is searched against a corpus and the best-ranked documents
that are *not* known to be relevant become its hard negatives:

1. The corpus is the training documents: the pairs' positives, one entry per document id
   (:mod:`.corpus`).
2. Corpus and queries are encoded by one model (a checkpoint, an exported model directory or
   the base encoder) and each query's top candidates are found with FAISS (inner product: the
   training score; cosine for a normalizing model), deep enough for the rank window
   (:mod:`.search`).
3. Candidates are removed by the filters, in a fixed order, and ``n_negatives`` of those that pass
   are kept per query (:mod:`.filters`, which lists the rules); :mod:`.miner` runs steps 1-3 and
   counts what each rule removed.
4. With a teacher (``teacher=PATH``, :mod:`.teacher`), its scores of each kept positive and
   negative are written in place of the mining model's, and with ``filter_scores=teacher`` the
   score filters judge the candidates by them (what ``objective.distill`` learns).
5. The output is the training JSONL of :mod:`moco_retrieval.data.formats` plus a statistics file
   (:mod:`.output`); :mod:`.report` says what was mined and what a user must know before training.

The package's names are importable from ``moco_retrieval.mining``.
"""
from moco_retrieval.mining.corpus import Corpus, build_corpus
from moco_retrieval.mining.filters import (
    REMOVAL_REASONS,
    SAMPLINGS,
    SCORE_FILTERS,
    Candidate,
    MiningFilters,
    filter_candidates,
    new_counts,
    sample_candidates,
)
from moco_retrieval.mining.miner import MiningOptions, MiningResult, mine_from_embeddings, mine_hard_negatives
from moco_retrieval.mining.output import stats_path_for, write_mined
from moco_retrieval.mining.report import dropped_rows_warning, format_stats

__all__ = [
    "Candidate",
    "Corpus",
    "MiningFilters",
    "MiningOptions",
    "MiningResult",
    "REMOVAL_REASONS",
    "SAMPLINGS",
    "SCORE_FILTERS",
    "build_corpus",
    "dropped_rows_warning",
    "filter_candidates",
    "format_stats",
    "mine_from_embeddings",
    "mine_hard_negatives",
    "new_counts",
    "sample_candidates",
    "stats_path_for",
    "write_mined",
]
