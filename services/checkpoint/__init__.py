"""The checkpoint service: owns the catalog (SQL read models of sessions, training runs,
checkpoints and samplers, rebuilt from the event log), answers the REST API's reads and changes
and what a tinker:// path refers to, deletes expired checkpoints, and garbage-collects orphaned
blobs."""
