"""Export's extra memory: how much above the trained model's own footprint ``export`` needs (issue 35:
a 7B embedder exported on the machine that trained it).

Random BERT-shaped backbones of about 400 and 800 MiB (hidden 1024, 12 and 24 layers, fp32) are
exported as a sentence-transformers folder (``moco_retrieval.export.writer.export_encoder``), plain and with LoRA adapters
(r 8), which ``writer.save_merged`` merges into the weights one file at a time; its file-size
limit (``moco_retrieval.export.writer.SHARD_BYTES``) is varied, 50 GB being transformers' default (one file).
Each case runs in a fresh process and reports two peaks above the memory before the export:
resident memory (VmHWM, reset just before through ``/proc/self/clear_refs``), which counts the
written and re-read files' pages that the process maps (page cache the kernel can drop), and
anonymous memory (RssAnon, sampled every 2 ms by a thread), the part that can run a machine out
of memory.

    python -m benchmarks.export_memory            # all cases, about a minute
    python -m benchmarks.export_memory --report   # rewrite the report from results/export_memory.json
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from benchmarks.harness import cli
from benchmarks.harness.report import environment
from benchmarks.harness.runs import md_table, write_results

NAME = "export_memory"
MIB = 2**20
LIMITS = {"50 GB (one file)": 50 * 10**9, "256 MiB (the default)": 256 * MIB, "64 MiB": 64 * MIB}
HIDDEN = 1024
CASES = [(12, False, ""), *((12, True, label) for label in LIMITS),  # (layers, LoRA, merged file limit)
         (24, False, ""), (24, True, "256 MiB (the default)"), (24, True, "64 MiB")]


def one_case(model_dir: str, lora: bool, limit: int, out: str) -> dict:
    """In this (fresh) process: build the encoder, export it, return the export's extra peak RSS."""
    import torch

    from moco_retrieval.config import LoraConfig, ModelConfig
    from moco_retrieval.export import writer
    from moco_retrieval.export.writer import export_encoder
    from moco_retrieval.model.encoder import build_encoder

    torch.set_num_threads(1)
    cfg = ModelConfig(backbone="tiny", path=model_dir, lora=LoraConfig(r=8, alpha=16) if lora else LoraConfig())
    enc = build_encoder(cfg).eval()
    model_bytes = sum(p.numel() * p.element_size() for p in enc.parameters())
    writer.SHARD_BYTES = limit or writer.SHARD_BYTES  # save_merged reads it when it runs
    before, anon_before = _status_kib("VmRSS"), _status_kib("RssAnon")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the RSS now
    with AnonPeak() as anon:
        folder = export_encoder(enc, out)
    assert (folder / "modules.json").is_file()
    return {"model_MiB": model_bytes / MIB, "extra_rss_MiB": (_status_kib("VmHWM") - before) / 1024,
            "extra_anon_MiB": (anon.peak - anon_before) / 1024}


class AnonPeak:
    """The largest RssAnon (KiB) seen by a thread reading /proc/self/status every 2 ms."""

    def __enter__(self):
        self.peak, self._stop = _status_kib("RssAnon"), threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _status_kib("RssAnon"))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status_kib("RssAnon"))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(tmp: Path) -> list[dict]:
    from moco_retrieval.model.tiny import build_tiny_bert

    rows = []
    for layers, lora, label in CASES:
        model_dir = tmp / f"bert{layers}"
        if not model_dir.is_dir():
            build_tiny_bert(model_dir, hidden=HIDDEN, layers=layers, heads=16)
        out = tmp / f"out-{len(rows)}"
        limit = LIMITS.get(label, 0)
        code = ("import json; from benchmarks import export_memory as m; "
                f"print(json.dumps(m.one_case({str(model_dir)!r}, {lora}, {limit}, {str(out)!r})))")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        row = {"layers": layers, "lora": lora, "file_limit": label, **json.loads(res.stdout.strip().splitlines()[-1])}
        print(row, flush=True)
        rows.append(row)
    return rows


def report(data: dict) -> str:
    rows = [(r["layers"], "LoRA r 8, merged" if r["lora"] else "plain", r["file_limit"] or "(no merge)", f"{r['model_MiB']:.0f}",
             f"{r['extra_rss_MiB']:.0f}", f"{r['extra_anon_MiB']:.0f}",
             f"{r['extra_anon_MiB'] / r['model_MiB']:.2f}")
            for r in data["rows"]]
    return "\n".join([
        "# Export's extra memory (issue 35)",
        "",
        __doc__.split("\n\n")[1].replace("\n", " "),
        "",
        md_table(["layers", "backbone", "merged file limit", "model MiB", "extra peak RSS MiB",
                  "extra peak anonymous MiB", "anonymous ÷ model"], rows),
        "",
        f"Measured {data['environment']['date_utc']} UTC, CPU, torch {data['environment']['torch']}, "
        f"transformers {data['environment']['transformers']}.",
    ])


def main() -> None:
    ap = cli.parser(__doc__)
    cli.add_report(ap)
    ap.add_argument("--out", default=str(cli.RESULTS))
    args = ap.parse_args()
    path = Path(args.out) / f"{NAME}.json"
    if args.report:
        data = json.loads(path.read_text(encoding="utf-8"))
    else:
        with tempfile.TemporaryDirectory(prefix="export-memory-") as tmp:
            data = {"rows": measure(Path(tmp)), "environment": environment(), "hidden": HIDDEN}
    md, _ = write_results(NAME, report(data), data, Path(args.out))
    print(md.read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()
