"""Training: the Lightning module and what a run keeps and checks around it.

module.py (RetrievalModule, the Embeddings it serves objectives), checkpoints.py, preemption.py,
run_lock.py (one job per run directory), loggers.py, records.py (the run's clock and metrics.csv),
report.py (progress and validation lines), resume_check.py, finite_guard.py, cluster.py (what the
launcher's environment says)."""
