"""Recording the calls of a method in a test, the method still running."""

from __future__ import annotations

import pytest


def record_calls(
    monkeypatch: pytest.MonkeyPatch, owner: type, name: str
) -> list[tuple[object, ...]]:
    """The positional arguments (``self`` first) of each call of ``owner.name`` from now on, until
    ``monkeypatch`` undoes it; each call still runs the method."""
    calls: list[tuple[object, ...]] = []
    method = getattr(owner, name)

    def recorded(*args: object, **kwargs: object) -> object:
        calls.append(args)
        return method(*args, **kwargs)

    monkeypatch.setattr(owner, name, recorded)
    return calls
