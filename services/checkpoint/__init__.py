"""The checkpoint service: owns the catalog of checkpoints, rebuilt from the event log, and
answers what a tinker:// path refers to."""
