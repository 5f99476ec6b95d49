"""``python -m moco_retrieval.mine``: hard negatives for the training pairs (mining itself: the mining package).

    python -m moco_retrieval.mine output=mined.jsonl                          # Debian set, base MiniLM
    python -m moco_retrieval.mine checkpoint=RUN/checkpoints/last.ckpt output=mined.jsonl
    python -m moco_retrieval.mine model_dir=EXPORTED data=jsonl data.train_path=pairs.jsonl output=mined.jsonl \\
        n_negatives=8 range_min=0 range_max=50 relative_margin=0.05 margin=null max_score=null sampling=top
    python -m moco_retrieval.mine ... teacher=CROSS_ENCODER_DIR [filter_scores=teacher]   # scores to distil

Keys: MineConfig in config.py (``conf/mine.yaml``). Writes ``output`` (training JSONL with
``negatives`` and ``positive_score``: the mining model's scores, or with ``teacher`` the teacher's,
what ``objective.distill`` learns) and ``<output stem>.stats.json`` (what each filter removed).
Then train with ``data=jsonl data.train_path=OUTPUT data.eval_dir=DIR data.n_negatives=N``. An existing
``output`` is refused unless ``overwrite=true``; an input (the training pairs, ...) is refused always.
"""
# The output is refused before anything is read when it is a directory, exists (unless overwrite=true)
# or is one of the command's inputs (files.py); it is written atomically. Rows left without a
# negative are not written unless keep_empty: a warning says how many and why, and the printed
# training command says what part of the pairs it trains on.
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from moco_retrieval.command import command
from moco_retrieval.data.formats import Pair
from moco_retrieval.errors import ConfigError
from moco_retrieval.mining import (
    MiningFilters,
    MiningOptions,
    MiningResult,
    build_corpus,
    dropped_rows_warning,
    format_stats,
    mine_hard_negatives,
    stats_path_for,
    write_mined,
)



def to_mine_config(cfg: DictConfig):
    """The composed DictConfig as a MineConfig; a missing required value is an error naming it."""
    if OmegaConf.is_missing(cfg.data, "eval_dir"):  # data=jsonl asks for it; mining reads only train_path
        cfg.data.eval_dir = None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError("missing required config values: " + ", ".join(missing) + " (e.g. output=FILE)")
    return OmegaConf.to_object(cfg)


def load_training_pairs(data_cfg: Any) -> list[Pair]:
    """The training pairs of a DataConfig (capped as in training); ``kind=jsonl`` needs only ``train_path`` here."""
    from moco_retrieval.data.sources import load_training_pairs as load_pairs

    return load_pairs(data_cfg).pairs


def eval_option(data_cfg: Any) -> str:
    """The BEIR folder(s) to validate on after mining, as the training command's option: the data
    config's eval_dirs, the built Debian set's eval/ folder, its eval_dir, else the placeholder DIR."""
    if getattr(data_cfg, "eval_dirs", None):
        return "data.eval_dirs=[" + ",".join(str(d) for d in data_cfg.eval_dirs) + "]"
    return f"data.eval_dir={_eval_folder(data_cfg)}"


def _eval_folder(data_cfg: Any) -> str:
    if data_cfg.kind == "debian":
        from moco_retrieval.data.sources import debian_folder

        return str(debian_folder(data_cfg) / "eval")
    if data_cfg.kind == "beir" and getattr(data_cfg, "dir", None):
        return str(data_cfg.dir)  # its qrels/<eval_split>.tsv: also set data.eval_split
    return str(getattr(data_cfg, "eval_dir", None) or "DIR")


def mining_inputs(cfg: Any) -> dict[str, list[Path]]:
    """What ``mine`` reads, by the key that names it: the output is never one of these files."""
    from moco_retrieval.files import files_under

    data = cfg.data
    inputs = {f"data.{key}": files_under(getattr(data, key, None)) for key in ("train_path", "eval_dir", "dir", "debian_dir")}
    for i, source in enumerate(getattr(data, "sources", None) or []):  # (several training sources, where configured)
        for key in ("train_path", "dir"):
            inputs[f"data.sources[{i}].{key}"] = files_under(getattr(source, key, None))
    if data.kind == "debian":
        from moco_retrieval.data.sources import debian_folder

        inputs["the built Debian data set"] = files_under(debian_folder(data))
    inputs.update({key: files_under(getattr(cfg, key, None)) for key in ("checkpoint", "model_dir", "teacher")})
    inputs["model.path"] = files_under(getattr(cfg.model, "path", None))
    return inputs


def check_mine_outputs(cfg: Any) -> tuple[Path, Path]:
    """``(output, stats file)``, refused (one message naming the key) before anything is read when
    either is a directory, there already without ``overwrite``, or an input (see files.py)."""
    from moco_retrieval.files import check_output

    if not cfg.output:
        raise ConfigError("output=FILE is required (the JSONL of pairs with mined negatives)")
    out = Path(cfg.output).expanduser()
    stats_file = Path(cfg.stats_path).expanduser() if cfg.stats_path else stats_path_for(out)
    check_output(out, "output", True, {})  # (a directory: said before the inputs are listed, a Debian set built)
    inputs = mining_inputs(cfg)
    check_output(out, "output", bool(cfg.overwrite), inputs)
    check_output(stats_file, "stats_path", bool(cfg.overwrite), {**inputs, "output": [out]})
    return out, stats_file


def next_command(stats: dict, out: Path, cfg: Any) -> str:
    """The training command for ``out``, saying what part of the pairs it trains on."""
    command = (f"data=jsonl data.train_path={out} {eval_option(cfg.data)} "
               f"data.n_negatives={cfg.n_negatives}" + (" objective.distill=kl" if cfg.teacher else ""))
    with_negatives, total = stats["queries"] - stats["queries_without_negatives"], stats["queries"]
    if with_negatives == total:
        return f"train with: {command}"
    if cfg.keep_empty:
        return (f"train with (data.n_negatives refuses the {total - with_negatives:,} rows written without negatives; "
                f"keep_empty=false leaves them out): {command}")
    return (f"train with (on {with_negatives:,} of your {total:,} training pairs, {100 * with_negatives / total:.1f}%: "
            f"only the rows that got negatives): {command}")


def mining_settings(cfg: Any) -> tuple[MiningFilters, MiningOptions]:
    """The filters and options of a MineConfig, checked (one message naming the key)."""
    filters = MiningFilters(
        range_min=cfg.range_min, range_max=cfg.range_max, margin=cfg.margin, relative_margin=cfg.relative_margin,
        max_score=cfg.max_score, drop_group=cfg.drop_group,
    ).check()
    options = MiningOptions(n_negatives=cfg.n_negatives, sampling=cfg.sampling, seed=cfg.seed, keep_empty=cfg.keep_empty,
                            index_cfg=cfg.eval, progress=cfg.progress).check()
    check_teacher(cfg)
    return filters, options


def check_teacher(cfg: Any) -> None:
    """``filter_scores=teacher`` needs a teacher, and a teacher that is the mining model adds nothing
    (its scores are the ones written already)."""
    if cfg.filter_scores == "teacher" and not cfg.teacher:
        raise ConfigError("filter_scores=teacher judges candidates by a teacher's scores: give teacher=PATH")
    if not cfg.teacher:
        return
    teacher = Path(cfg.teacher).expanduser().resolve()
    if not teacher.exists():  # (said before the mining model loads)
        from moco_retrieval.errors import ModelNotFoundError

        raise ModelNotFoundError(f"teacher={cfg.teacher}: no such file or directory (expected a checkpoint, a "
                                 "sentence-transformers folder or a CrossEncoder folder)")
    for key in ("checkpoint", "model_dir"):
        if getattr(cfg, key, None) and Path(getattr(cfg, key)).expanduser().resolve() == teacher:
            raise ConfigError(f"teacher={cfg.teacher} is the mining model ({key}): its scores are written without it; "
                              "give another model as teacher (a larger embedder or a cross-encoder), or leave teacher out")


def prepare_encoding(encoder: Any, pairs: list[Pair], cfg: Any) -> None:
    """Before encoding: a frozen backbone's features computed (and cached) once; else a line saying
    how many texts and about how long."""
    if encoder.frozen:
        encoder.warm_features(encoder.prompts.apply([p.query for p in pairs], "query"),
                              encoder.prompts.apply(build_corpus(pairs).texts, "doc"), progress=cfg.progress)
        return
    from moco_retrieval.evaluation.forecast import announce_encoding

    announce_encoding(encoder, [(build_corpus(pairs).texts, "doc"), ([p.query for p in pairs], "query")],
                      f"the training pairs of data={cfg.data.kind}", cfg.batch_size,
                      "data.max_train_examples=N mines a seeded subset")


def write_outputs(result: MiningResult, out: Path, stats_file: Path) -> None:
    """The training JSONL and the statistics, each written atomically."""
    from moco_retrieval.files import atomic_write

    with atomic_write(out) as tmp:
        write_mined(tmp, result)
    with atomic_write(stats_file) as tmp:
        tmp.write_text(json.dumps(result.stats, indent=2, default=str) + "\n", encoding="utf-8")


def report_outputs(stats: dict, out: Path, stats_file: Path, cfg: Any) -> None:
    """The statistics, the files written, the warning for rows left without negatives, the next command."""
    print(format_stats(stats))
    print(f"wrote {out} and {stats_file}")
    warning = dropped_rows_warning(stats, out, bool(cfg.keep_empty))
    if warning:
        from moco_retrieval.errors import wrap_message

        print(wrap_message(warning), file=sys.stderr, flush=True)
    print(next_command(stats, out, cfg))


def run_mine(cfg: Any) -> MiningResult:
    """``python -m moco_retrieval.mine``: load the model and pairs, mine, write JSONL and stats."""
    from moco_retrieval.model.loading import load_encoder

    out, stats_file = check_mine_outputs(cfg)
    filters, options = mining_settings(cfg)
    pairs = load_training_pairs(cfg.data)
    encoder, desc = load_encoder(checkpoint=cfg.checkpoint, model_dir=cfg.model_dir, model=cfg.model, encoder=cfg.encoder,
                                 prompts=cfg.data.prompts)
    print(f"mining with {desc['source']} encoder ({desc.get('path', desc.get('backbone'))}, dim {encoder.dim}) "
          f"for {len(pairs):,} training pairs", file=sys.stderr)
    teacher = None
    if cfg.teacher:
        from moco_retrieval.mining.teacher import load_teacher

        teacher = load_teacher(cfg.teacher, cfg.model)
        print(f"scoring with the {teacher.kind} teacher {teacher.description.get('path')} "
              f"(the score filters judge the {cfg.filter_scores}'s scores)", file=sys.stderr)
    prepare_encoding(encoder, pairs, cfg)
    result = mine_hard_negatives(encoder, pairs, filters, options, batch_size=cfg.batch_size, teacher=teacher,
                                 filter_by_teacher=cfg.filter_scores == "teacher")
    result.stats["model"] = desc
    result.stats["output"] = str(out)
    write_outputs(result, out, stats_file)
    report_outputs(result.stats, out, stats_file, cfg)
    return result


@command("mine")
def main(cfg: DictConfig) -> None:
    run_mine(to_mine_config(cfg))


if __name__ == "__main__":
    main()
