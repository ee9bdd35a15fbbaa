"""The gateway: turns Tinker HTTP calls into events on the log, and answers futures from its
projection of that log."""
