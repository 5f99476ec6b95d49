"""Training: the Lightning module and everything a run keeps and checks."""
