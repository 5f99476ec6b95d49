"""objective.distill (objectives/distill.py): a teacher's scores of each row's positive and hard
negatives, learnt by KL or MarginMSE, alone or beside the contrastive loss, against loop references."""
from __future__ import annotations

import math

import pytest
import torch
from tests.helpers import Given, encoder_stub, labels, ref_direction, unit

from moco_retrieval.config import ConfigError
from moco_retrieval.objectives.inbatch import InBatchConfig
from moco_retrieval.objectives.moco import MoCoConfig
from moco_retrieval.objectives.registry import build_objective, objective_config
from moco_retrieval.objectives.two_queue import TwoQueueConfig

TAU, D, B, N = 0.1, 8, 4, 3
IDS = torch.tensor([10, 11, 12, 13])
GROUPS = torch.tensor([-1, -1, -1, -1])
NEG_IDS, NEG_GROUPS = torch.arange(100, 100 + B * N), torch.full((B * N,), -1)
POS_SCORE = torch.tensor([5.0, 1.0, 3.0, 0.5])
NEG_SCORE = torch.tensor([4.0, 1.0, -2.0, 0.0, 2.0, 1.0, 3.0, 3.5, -1.0, 0.2, 0.4, 0.6])


def batch():
    return labels(IDS, GROUPS, neg_id=NEG_IDS, neg_group=NEG_GROUPS, pos_score=POS_SCORE, neg_score=NEG_SCORE)


def ref_kl(q, pos, neg, temperature=1.0, tau=TAU):
    """T^2 * mean over rows of sum_j p_j log(p_j / s_j): p the teacher's softmax of scores / T, s the
    student's of (q . doc / tau) / T over [positive, the row's own negatives], element by element."""
    q, pos, neg, total = q.detach(), pos.detach(), neg.detach(), 0.0
    for i in range(B):
        student = [float(q[i] @ pos[i]) / tau / temperature] + [float(q[i] @ neg[i * N + j]) / tau / temperature
                                                                 for j in range(N)]
        teacher = [float(POS_SCORE[i]) / temperature] + [float(NEG_SCORE[i * N + j]) / temperature for j in range(N)]
        zs, zt = sum(math.exp(x) for x in student), sum(math.exp(x) for x in teacher)
        for s, t in zip(student, teacher):
            p = math.exp(t) / zt
            total += p * (math.log(p) - (s - math.log(zs)))
    return temperature ** 2 * total / B


def ref_margin_mse(q, pos, neg):
    """The mean over rows and negatives of ((q.pos - q.neg) - (teacher pos - teacher neg))^2."""
    q, pos, neg = q.detach(), pos.detach(), neg.detach()
    errors = [((float(q[i] @ pos[i]) - float(q[i] @ neg[i * N + j])) - float(POS_SCORE[i] - NEG_SCORE[i * N + j])) ** 2
              for i in range(B) for j in range(N)]
    return sum(errors) / len(errors)


def embeddings(seed=0):
    return unit(B, D, seed=seed + 1).requires_grad_(), unit(B, D, seed=seed + 2), unit(B * N, D, seed=seed + 3)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_kl_alone_with_in_batch_negatives_matches_the_loop(temperature):
    """contrastive_weight=0: the loss is the KL term alone; the in-batch documents and hard negatives
    are embedded with gradient and get it from the term."""
    cfg = InBatchConfig(temperature=TAU, distill="kl", distill_temperature=temperature, distill_weight=0.5,
                        contrastive_weight=0.0)
    obj = build_objective(cfg, encoder_stub(D)).train()
    q, d, neg = embeddings()
    d, neg = d.clone().requires_grad_(), neg.clone().requires_grad_()
    loss, stats = obj(batch(), Given(query=q, doc=d, neg=neg))
    assert loss.item() == pytest.approx(0.5 * ref_kl(q, d, neg, temperature), rel=1e-5)
    assert stats["loss_distill"].item() == pytest.approx(ref_kl(q, d, neg, temperature), rel=1e-5)
    loss.backward()
    assert q.grad.abs().sum() > 0 and d.grad.abs().sum() > 0 and neg.grad.abs().sum() > 0


def test_kl_beside_in_batch_contrastive_is_the_weighted_sum():
    cfg = InBatchConfig(temperature=TAU, distill="kl", distill_weight=2.0)
    obj = build_objective(cfg, encoder_stub(D)).train()
    q, d, neg = embeddings(seed=10)
    loss, stats = obj(batch(), Given(query=q, doc=d, neg=neg))
    contrastive = ref_direction(q, d, d, IDS, GROUPS, [(neg, NEG_IDS, NEG_GROUPS)], TAU)
    assert stats["loss_contrastive"].item() == pytest.approx(contrastive.item(), rel=1e-5)
    assert loss.item() == pytest.approx(contrastive.item() + 2.0 * ref_kl(q, d, neg), rel=1e-5)


def test_margin_mse_with_moco_and_its_queue_matches_the_loop():
    """MoCo: the student's scores are the queries against the EMA keys (positive and hard negatives);
    the queued keys stay in the contrastive softmax alone."""
    cfg = MoCoConfig(queue_size=8, temperature=TAU, distill="margin_mse", distill_weight=3.0)
    obj = build_objective(cfg, encoder_stub(D)).train()
    queue, q_ids, q_groups = unit(8, D, seed=7), torch.arange(200, 208), torch.full((8,), -1)
    obj.docs.queue.enqueue(queue, q_ids, q_groups, step=0)
    q, k, neg = embeddings(seed=20)
    loss, stats = obj(batch(), Given(query=q, doc_key=k, neg_key=neg))
    contrastive = ref_direction(q, k, k, IDS, GROUPS, [(neg, NEG_IDS, NEG_GROUPS), (queue, q_ids, q_groups)], TAU)
    assert stats["loss_distill"].item() == pytest.approx(ref_margin_mse(q, k, neg), rel=1e-5)
    assert loss.item() == pytest.approx(contrastive.item() + 3.0 * ref_margin_mse(q, k, neg), rel=1e-5)
    loss.backward()
    assert q.grad.abs().sum() > 0


def test_margin_mse_alone_is_zero_when_the_student_has_the_teachers_margins():
    """A check that does not lean on the reference: a teacher whose scores are the student's own."""
    q, k, neg = embeddings(seed=30)
    obj = build_objective(InBatchConfig(temperature=TAU, distill="margin_mse", contrastive_weight=0.0), encoder_stub(D))
    b = dict(batch(), pos_score=(q * k).sum(1).detach(),
             neg_score=torch.einsum("bd,bnd->bn", q, neg.view(B, N, D)).reshape(-1).detach())
    loss, _ = obj(b, Given(query=q, doc=k, neg=neg))
    assert loss.item() == pytest.approx(0.0, abs=1e-10)


def test_kl_with_two_queue_adds_the_term_to_its_directions():
    """two_queue: the term on the query -> document direction, added to its (unchanged) total."""
    q, k, neg = embeddings(seed=40)
    d, q_key = unit(B, D, seed=44), unit(B, D, seed=45)
    given = dict(query=q, doc=d, doc_key=k, query_key=q_key, neg_key=neg)
    plain = build_objective(TwoQueueConfig(queue_size=8, temperature=TAU), encoder_stub(D)).train()
    distilled = build_objective(TwoQueueConfig(queue_size=8, temperature=TAU, distill="kl"), encoder_stub(D)).train()
    base, _ = plain(batch(), Given(**given))
    loss, _ = distilled(batch(), Given(**given))
    assert loss.item() == pytest.approx(base.item() + ref_kl(q, k, neg), rel=1e-5)


def test_matryoshka_distils_at_each_prefix():
    q, d, neg = embeddings(seed=50)
    cfg = InBatchConfig(temperature=TAU, distill="kl", contrastive_weight=0.0, matryoshka_dims=[8, 4])
    loss, _ = build_objective(cfg, encoder_stub(D))(batch(), Given(query=q, doc=d, neg=neg))
    cut = lambda x: torch.nn.functional.normalize(x[..., :4], dim=-1)  # noqa: E731
    assert loss.item() == pytest.approx(ref_kl(q, d, neg) + ref_kl(cut(q), cut(d), cut(neg)), rel=1e-5)


@pytest.mark.parametrize("options, says", [
    ({"distill_weight": 2.0}, "objective.distill_weight=2.0 weighs the distillation term, which is off"),
    ({"contrastive_weight": 0.0}, "objective.contrastive_weight=0.0 weighs the distillation term, which is off"),
    ({"distill": "margin_mse", "distill_temperature": 2.0}, "softens the softmaxes of objective.distill=kl"),
    ({"distill": "kl", "distill_weight": 0.0}, "objective.distill_weight=0.0: must be > 0"),
    ({"distill": "kd"}, "objective.distill='kd': expected one of none, kl, margin_mse"),
])
def test_distill_options_are_refused_where_they_do_nothing(options, says):
    with pytest.raises(ConfigError, match=None) as e:
        objective_config({"name": "inbatch", **options})
    assert says in str(e.value)


def test_distilling_without_hard_negatives_is_refused_at_composition(tiny_dir):
    from tests.helpers import compose_cfg, tiny_overrides

    with pytest.raises(Exception) as e:
        compose_cfg("train", [*tiny_overrides(tiny_dir), "objective=inbatch", "objective.distill=kl"], to_object=True)
    assert "objective.distill=kl learns the teacher's scores of each row's hard negatives: set data.n_negatives=N" in str(e.value)


def _distill_rank(q, d, neg, rank, world):
    """One gloo rank's KL term over its B // world rows (in-batch: documents and hard negatives gathered)."""
    per = B // world
    obj = build_objective(InBatchConfig(temperature=TAU, distill="kl", contrastive_weight=0.0), encoder_stub(D)).train()
    b = labels(IDS[rank * per:(rank + 1) * per], GROUPS[rank * per:(rank + 1) * per],
               neg_id=NEG_IDS[rank * per * N:(rank + 1) * per * N], neg_group=NEG_GROUPS[rank * per * N:(rank + 1) * per * N],
               pos_score=POS_SCORE[rank * per:(rank + 1) * per], neg_score=NEG_SCORE[rank * per * N:(rank + 1) * per * N])
    loss, _ = obj(b, Given(query=q[rank * per:(rank + 1) * per], doc=d[rank * per:(rank + 1) * per],
                           neg=neg[rank * per * N:(rank + 1) * per * N]))
    return loss.detach()


def test_each_gloo_rank_distils_its_own_rows_against_their_own_negatives(tmp_path):
    """Gathered across ranks, rank r's rows start at r * B * n among the hard negatives: each rank's
    term is the loop reference over its own rows (rank 1 reading rank 0's negatives would not be)."""
    from tests.helpers import on_ranks

    q, d, neg = (x.detach() for x in embeddings(seed=60))
    losses = on_ranks(_distill_rank, (q, d, neg), 2, tmp_path)
    per_row = [_ref_rows(q, d, neg, [i]) for i in range(B)]
    for r, loss in enumerate(losses):
        assert float(loss) == pytest.approx(sum(per_row[r * 2:(r + 1) * 2]) / 2, rel=1e-5)


def _ref_rows(q, d, neg, rows):
    """ref_kl's sum over ``rows`` alone."""
    total = 0.0
    for i in rows:
        student = [float(q[i] @ d[i]) / TAU] + [float(q[i] @ neg[i * N + j]) / TAU for j in range(N)]
        teacher = [float(POS_SCORE[i])] + [float(NEG_SCORE[i * N + j]) for j in range(N)]
        zs, zt = sum(math.exp(x) for x in student), sum(math.exp(x) for x in teacher)
        total += sum(math.exp(t) / zt * (t - math.log(zt) - (s - math.log(zs))) for s, t in zip(student, teacher))
    return total
