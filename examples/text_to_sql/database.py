"""The example's SQLite database, and the only way the example runs SQL on it.

Owns: the schema (``SCHEMA``; ``TABLES``, which every prompt names), the rows, drawn from a
seeded ``random.Random`` so that a seed always gives the same database, and ``Database.run``: one
statement, read-only, with a bounded amount of work and a bounded result. Does not own: the
questions (``questions``) or what counts as a right answer (``reward``).

The database is a small company: 8 departments, 120 employees, 60 customers, 35 products and
300 orders, in memory. Salaries and prices are all different, so "the three best-paid" and "the
most expensive" have one answer each. Model-written SQL is untrusted: an authorizer lets a
statement read tables and call functions and nothing else (no writes, no schema changes, no
ATTACH, no PRAGMA), ``query_only`` is on as a second lock, a progress handler stops a statement
after ``MAX_STEPS`` virtual-machine steps, no value may exceed ``MAX_VALUE_BYTES``, and a result
of more than ``MAX_ROWS`` rows is refused.
"""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Sequence
from typing import Any

SCHEMA = """
CREATE TABLE departments (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL);
CREATE TABLE employees (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL, department_id INTEGER NOT NULL
    REFERENCES departments (id), salary INTEGER NOT NULL, hire_year INTEGER NOT NULL);
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL);
CREATE TABLE products (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL, price INTEGER NOT NULL);
CREATE TABLE orders (
    id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers (id),
    product_id INTEGER NOT NULL REFERENCES products (id), quantity INTEGER NOT NULL,
    year INTEGER NOT NULL);
"""

DEPARTMENTS = (
    "Engineering", "Sales", "Marketing", "Finance", "Support", "Legal", "Research", "Operations",
)  # fmt: skip
CITIES = ("Lisbon", "Oslo", "Austin", "Nairobi", "Osaka", "Lima", "Dublin", "Perth")
CATEGORIES = ("books", "garden", "kitchen", "sports", "toys")
PRODUCTS = {
    "books": ("atlas", "cookbook", "diary", "novel", "poetry book", "comic", "dictionary", "map"),
    "garden": ("hose", "rake", "shovel", "planter", "seed pack", "lawn chair", "watering can"),
    "kitchen": ("kettle", "blender", "frying pan", "teapot", "toaster", "knife set", "mixer"),
    "sports": ("football", "tennis racket", "yoga mat", "helmet", "skateboard", "dumbbell"),
    "toys": ("kite", "puzzle", "robot", "teddy bear", "yo-yo", "train set", "doll house"),
}
FIRST_NAMES = (
    "Ada", "Ben", "Carla", "Dev", "Elif", "Femi", "Gus", "Hana", "Ivan", "Jia", "Kofi", "Lena",
    "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tess", "Umar", "Vera", "Wen",
    "Ximena", "Yusuf", "Zoe",
)  # fmt: skip
LAST_NAMES = (
    "Alves", "Berg", "Chen", "Diaz", "Eze", "Fischer", "Garcia", "Haddad", "Ito", "Jensen",
    "Khan", "Lopez", "Moreau", "Novak", "Okafor", "Park", "Rossi", "Silva", "Tanaka", "Weber",
)  # fmt: skip
HIRE_YEARS = range(2012, 2024)
ORDER_YEARS = range(2019, 2025)
TABLES = ("departments", "employees", "customers", "products", "orders")
COUNTS = {"employees": 120, "customers": 60, "orders": 300}

MAX_STEPS = 2_000_000  # virtual-machine steps per statement: ~0.1 s; every reference needs <1%
PROGRESS_EVERY = 1_000  # steps between progress-handler calls
MAX_ROWS = 1_000
MAX_VALUE_BYTES = 100_000
# What a statement may do: read columns, select, call functions (and recurse in a CTE).
_ALLOWED = frozenset(
    {sqlite3.SQLITE_READ, sqlite3.SQLITE_SELECT, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
)

Rows = list[tuple[Any, ...]]


class SQLRefused(Exception):
    """A statement that did not run, or whose result was refused; the message says why."""


class Database:
    """The company database of one seed, in memory, answering read-only statements."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._connection = sqlite3.connect(":memory:", check_same_thread=False)
        self._connection.executescript(SCHEMA)
        with self._connection:
            for table, rows in _rows(random.Random(seed)).items():
                marks = ", ".join("?" * len(rows[0]))
                self._connection.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)
        self._connection.execute("PRAGMA query_only = ON")
        self._connection.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        self._connection.set_authorizer(_authorize)
        self._connection.set_progress_handler(self._progress, PROGRESS_EVERY)
        self._steps_left = 0

    def run(self, sql: str) -> Rows:
        """The rows of one read-only statement; ``SQLRefused`` with the reason if it is not
        valid SQL for this schema, is more than one statement, would change anything, runs for
        more than ``MAX_STEPS`` steps or returns more than ``MAX_ROWS`` rows."""
        self._steps_left = MAX_STEPS // PROGRESS_EVERY
        cursor = self._connection.cursor()
        try:
            cursor.execute(sql)
            rows = cursor.fetchmany(MAX_ROWS + 1)
        except (sqlite3.Error, sqlite3.Warning, OverflowError, ValueError) as exc:
            # sqlite3.Warning: more than one statement; ValueError: a NUL character in it.
            raise SQLRefused(_reason(exc)) from None
        finally:
            cursor.close()
        if len(rows) > MAX_ROWS:
            raise SQLRefused(f"more than {MAX_ROWS} rows")
        return rows

    def counts(self) -> dict[str, int]:
        """Each table's number of rows."""
        return {table: self.run(f"SELECT COUNT(*) FROM {table}")[0][0] for table in TABLES}

    def values(self, sql: str) -> list[Any]:
        """The first column of a statement's rows: what the question templates fill in."""
        return [row[0] for row in self.run(sql)]

    def close(self) -> None:
        self._connection.close()

    def _progress(self) -> int:
        self._steps_left -= 1
        return 1 if self._steps_left < 0 else 0  # non-zero interrupts the statement


def _authorize(action: int, *_: str | None) -> int:
    return sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY


def _reason(exc: Exception) -> str:
    text = str(exc)
    if text == "interrupted":
        return f"stopped after {MAX_STEPS:,} steps"
    if "not authorized" in text:
        return "not authorized: only reading statements run here"
    return text


def _people(rng: random.Random, count: int) -> list[str]:
    everyone = [f"{first} {last}" for first in FIRST_NAMES for last in LAST_NAMES]
    return rng.sample(everyone, count)


def _rows(rng: random.Random) -> dict[str, Sequence[tuple[Any, ...]]]:
    """Every table's rows, in insertion order, from one random stream."""
    cities = rng.sample(CITIES, len(DEPARTMENTS))
    departments = [(i, name, cities[i - 1]) for i, name in enumerate(DEPARTMENTS, 1)]
    n_employees = COUNTS["employees"]
    salaries = rng.sample(range(40_000, 160_000, 250), n_employees)
    employees = [
        (i, name, rng.randint(1, len(DEPARTMENTS)), salaries[i - 1], rng.choice(HIRE_YEARS))
        for i, name in enumerate(_people(rng, n_employees), 1)
    ]
    customers = [
        (i, name, rng.choice(CITIES)) for i, name in enumerate(_people(rng, COUNTS["customers"]), 1)
    ]
    catalogue = [(name, category) for category in CATEGORIES for name in PRODUCTS[category]]
    prices = rng.sample(range(5, 500), len(catalogue))
    products = [
        (i, name, category, prices[i - 1]) for i, (name, category) in enumerate(catalogue, 1)
    ]
    orders = [
        (
            i,
            rng.randint(1, len(customers)),
            rng.randint(1, len(products)),
            rng.randint(1, 9),
            rng.choice(ORDER_YEARS),
        )
        for i in range(1, COUNTS["orders"] + 1)
    ]
    return {
        "departments": departments,
        "employees": employees,
        "customers": customers,
        "products": products,
        "orders": orders,
    }
