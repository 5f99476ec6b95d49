"""The corpus mined from: the training pairs' positives, one entry per document id, and per pair
what must never be its negative (its query's positives and their groups)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from moco_retrieval.data.formats import Negative, Pair
from moco_retrieval.data.ids import NO_GROUP, normalize_text
from moco_retrieval.mining.filters import Candidate


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

    def negative(self, c: Candidate) -> Negative:
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


__all__ = ["Corpus", "build_corpus"]
