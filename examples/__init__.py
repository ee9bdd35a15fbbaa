"""Example programs that drive tinsmith (or any Tinker service) through the official SDK."""
