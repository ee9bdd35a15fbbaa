"""The reward: run the model's SQL and compare its result with the reference's.

Owns: finding the SQL in a reply (``extract_sql``), comparing two results (``same_result``) and
the verdict on one reply (``Grader.grade``: 1 for the reference's result, 0 for anything else).
Does not own: running SQL safely (``database.Database.run`` refuses anything but one reading
statement, and bounds its work) or the questions (``questions``).

Results are compared as multisets of rows (the order of the rows does not count) unless the
reference orders them (``ORDER BY``), and then as lists. Column names do not count, the number of
columns does, and numbers are compared to six decimal places (``AVG`` of integers is a float, and
``5`` is ``5.0``). A reply with no SQL, SQL that does not run, and SQL with another result all get
0: no partial credit for SQL that merely runs, which a model that has seen a few examples
already earns almost always and would only blur the signal.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from examples.text_to_sql.database import Database, Rows, SQLRefused

RIGHT = "right"
WRONG = "wrong result"
NO_SQL = "no SQL"
_FENCE = re.compile(r"```[a-zA-Z]*\n?(.*?)(?:```|$)", re.DOTALL)
# Where SQL starts in a reply that has prose around it: a statement's first word, in capitals.
_STATEMENT = re.compile(
    r"\b(SELECT|WITH|INSERT|UPDATE|DELETE|REPLACE|CREATE|DROP|ALTER|PRAGMA|ATTACH|VACUUM)\b"
)


@dataclass(frozen=True)
class Verdict:
    reply: str  # what the model wrote
    sql: str  # what was run: the SQL in the reply ("" if it had none)
    outcome: str  # RIGHT, WRONG, NO_SQL, or why the SQL did not run

    @property
    def reward(self) -> float:
        return 1.0 if self.outcome == RIGHT else 0.0

    @property
    def right(self) -> bool:
        return self.outcome == RIGHT


def extract_sql(reply: str) -> str:
    """The SQL of a reply: the inside of its first fenced code block if it has one; else all of
    it if it starts like SQL (in any case), else what follows the first statement word in
    capitals; up to the first ``;``. A trained model replies with bare SQL, so this only
    matters to the untrained one, which is given the benefit of the doubt."""
    text = reply.strip()
    fenced = _FENCE.search(text)
    if fenced:
        text = fenced.group(1).strip()
    elif not _STATEMENT.match(text.upper()):
        start = _STATEMENT.search(text)
        text = text[start.start() :] if start else ""
    return text.split(";", 1)[0].strip()


def ordered(sql: str) -> bool:
    """Whether the order of a result's rows is part of the answer: the reference orders them."""
    return "ORDER BY" in sql.upper()


def same_result(got: Rows, want: Rows, in_order: bool) -> bool:
    """Whether two results are the same rows (in the same order if ``in_order``)."""
    got_rows = [_normal(row) for row in got]
    want_rows = [_normal(row) for row in want]
    if in_order:
        return got_rows == want_rows
    return Counter(got_rows) == Counter(want_rows)


class Grader:
    """Grades replies against references on one database; each reference is run once."""

    def __init__(self, database: Database) -> None:
        self.database = database
        self._references: dict[str, Rows] = {}

    def reference(self, sql: str) -> Rows:
        if sql not in self._references:
            self._references[sql] = self.database.run(sql)
        return self._references[sql]

    def grade(self, reply: str, reference_sql: str) -> Verdict:
        """The verdict on a model's reply to a question whose reference is ``reference_sql``."""
        sql = extract_sql(reply)
        if not sql:
            return Verdict(reply, sql, NO_SQL)
        try:
            rows = self.database.run(sql)
        except SQLRefused as exc:
            return Verdict(reply, sql, str(exc))
        want = self.reference(reference_sql)
        outcome = RIGHT if same_result(rows, want, ordered(reference_sql)) else WRONG
        return Verdict(reply, sql, outcome)


def _normal(row: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(round(value, 6) if isinstance(value, float) else value for value in row)
