"""The question/SQL pairs: templates filled in from the database, and the train/held-out split.

Owns: the templates (``TEMPLATES``: a question, its reference SQL, and the query that lists the
values it can be filled with), which of them are held out whole (``HELD_OUT_TEMPLATES``), the
pairs of one database (``pairs``), and the seeded split (``split``). Does not own: the database
(``database``) or the grading (``reward``).

Every pair's reference runs on the database and answers something: at least one row, and not a
lone NULL or 0 (a count of nobody is a dull question). The held-out set has two parts, graded
apart: new fillings of the templates that training sees ("Which customers live in Oslo?" held
out while "... in Lima?" is trained on), and whole templates that training never sees, made of
parts it does (a MIN where training has MAX and AVG; a count of customers by city where
training counts employees and lists customers by city).
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass

from examples.text_to_sql.database import Database

# The SQL that each department question starts from: its employees joined to their department.
_STAFF = "FROM employees JOIN departments ON department_id = departments.id"
_BOUGHT = (
    "FROM orders JOIN customers ON customer_id = customers.id"
    " JOIN products ON product_id = products.id"
)
_DEPARTMENTS = "SELECT name FROM departments ORDER BY id"
_CATEGORIES = "SELECT DISTINCT category FROM products ORDER BY category"
_CITIES = "SELECT DISTINCT city FROM customers ORDER BY city"
_CUSTOMERS = "SELECT name FROM customers ORDER BY id"


@dataclass(frozen=True)
class Template:
    name: str
    question: str  # with a "{}" for the value
    sql: str  # the reference, with a "{}" for the value
    values: str | range  # the values to fill in, or SQL whose first column lists them


TEMPLATES = (
    Template(
        "headcount",
        "How many employees work in the {} department?",
        f"SELECT COUNT(*) {_STAFF} WHERE departments.name = '{{}}'",
        _DEPARTMENTS,
    ),
    Template(
        "staff",
        "Who works in the {} department?",
        f"SELECT employees.name {_STAFF} WHERE departments.name = '{{}}'",
        _DEPARTMENTS,
    ),
    Template(
        "average_salary",
        "What is the average salary in the {} department?",
        f"SELECT AVG(salary) {_STAFF} WHERE departments.name = '{{}}'",
        _DEPARTMENTS,
    ),
    Template(
        "highest_salary",
        "What is the highest salary in the {} department?",
        f"SELECT MAX(salary) {_STAFF} WHERE departments.name = '{{}}'",
        _DEPARTMENTS,
    ),
    Template(
        "department_city",
        "In which city is the {} department?",
        "SELECT city FROM departments WHERE name = '{}'",
        _DEPARTMENTS,
    ),
    Template(
        "earn_more",
        "Which employees earn more than {} dollars?",
        "SELECT name FROM employees WHERE salary > {}",
        range(100000, 160000, 2500),
    ),
    Template(
        "hired_in",
        "Which employees were hired in {}?",
        "SELECT name FROM employees WHERE hire_year = {}",
        range(2012, 2024),
    ),
    Template(
        "hired_before",
        "How many employees were hired before {}?",
        "SELECT COUNT(*) FROM employees WHERE hire_year < {}",
        range(2013, 2024),
    ),
    Template(
        "best_paid",
        "Who are the {} best-paid employees?",
        "SELECT name FROM employees ORDER BY salary DESC LIMIT {}",
        range(2, 16),
    ),
    Template(
        "category_products",
        "Which products are in the {} category?",
        "SELECT name FROM products WHERE category = '{}'",
        _CATEGORIES,
    ),
    Template(
        "category_count",
        "How many products are in the {} category?",
        "SELECT COUNT(*) FROM products WHERE category = '{}'",
        _CATEGORIES,
    ),
    Template(
        "priciest",
        "What is the most expensive product in the {} category?",
        "SELECT name FROM products WHERE category = '{}' ORDER BY price DESC LIMIT 1",
        _CATEGORIES,
    ),
    Template(
        "cheaper_than",
        "Which products cost less than {} dollars?",
        "SELECT name FROM products WHERE price < {}",
        range(20, 500, 20),
    ),
    Template(
        "city_customers",
        "Which customers live in {}?",
        "SELECT name FROM customers WHERE city = '{}'",
        _CITIES,
    ),
    Template(
        "customer_orders",
        "How many orders has {} placed?",
        "SELECT COUNT(*) FROM orders JOIN customers ON customer_id = customers.id"
        " WHERE customers.name = '{}'",
        _CUSTOMERS,
    ),
    Template(
        "customer_products",
        "Which products has {} ordered?",
        f"SELECT DISTINCT products.name {_BOUGHT} WHERE customers.name = '{{}}'",
        _CUSTOMERS,
    ),
    Template(
        "product_buyers",
        "Which customers have ordered the {}?",
        f"SELECT DISTINCT customers.name {_BOUGHT} WHERE products.name = '{{}}'",
        "SELECT name FROM products ORDER BY id",
    ),
    Template(
        "orders_in_year",
        "How many orders were placed in {}?",
        "SELECT COUNT(*) FROM orders WHERE year = {}",
        range(2019, 2025),
    ),
    Template(
        "items_in_year",
        "How many items were ordered in {}?",
        "SELECT SUM(quantity) FROM orders WHERE year = {}",
        range(2019, 2025),
    ),
    # Held out whole (HELD_OUT_TEMPLATES): never trained on.
    Template(
        "lowest_salary",
        "What is the lowest salary in the {} department?",
        f"SELECT MIN(salary) {_STAFF} WHERE departments.name = '{{}}'",
        _DEPARTMENTS,
    ),
    Template(
        "city_customer_count",
        "How many customers live in {}?",
        "SELECT COUNT(*) FROM customers WHERE city = '{}'",
        _CITIES,
    ),
    Template(
        "hired_after",
        "How many employees were hired after {}?",
        "SELECT COUNT(*) FROM employees WHERE hire_year > {}",
        range(2012, 2023),
    ),
    Template(
        "cheapest",
        "What is the cheapest product in the {} category?",
        "SELECT name FROM products WHERE category = '{}' ORDER BY price LIMIT 1",
        _CATEGORIES,
    ),
)
HELD_OUT_TEMPLATES = frozenset({"lowest_salary", "city_customer_count", "hired_after", "cheapest"})
MAX_PER_TEMPLATE = 40  # so that the 60 customers do not make most of the questions about them
NEW_FILLINGS = "new fillings"  # the two parts of the held-out set
NEW_TEMPLATES = "new templates"


@dataclass(frozen=True)
class Pair:
    question: str
    sql: str  # the reference
    template: str


@dataclass(frozen=True)
class Split:
    train: list[Pair]
    held_out: list[Pair]

    def part(self, pair: Pair) -> str:
        """Which part of the held-out set ``pair`` is in."""
        return NEW_TEMPLATES if pair.template in HELD_OUT_TEMPLATES else NEW_FILLINGS


def pairs(database: Database, seed: int = 0) -> list[Pair]:
    """Every template filled in with up to ``MAX_PER_TEMPLATE`` of its values (a seeded
    choice), keeping only the pairs whose reference answers something; in template order."""
    rng = random.Random(seed)
    out = []
    for template in TEMPLATES:
        values = _values(database, template.values)
        if len(values) > MAX_PER_TEMPLATE:
            values = sorted(rng.sample(values, MAX_PER_TEMPLATE), key=values.index)
        for value in values:
            pair = Pair(template.question.format(value), template.sql.format(value), template.name)
            if answers_something(database, pair.sql):
                out.append(pair)
    return out


def split(all_pairs: list[Pair], held_out_share: float = 0.2, seed: int = 0) -> Split:
    """The pairs of ``HELD_OUT_TEMPLATES`` and a seeded ``held_out_share`` of every other
    template's pairs are held out, the rest are for training; both lists in a seeded order."""
    rng = random.Random(seed)
    by_template: defaultdict[str, list[Pair]] = defaultdict(list)
    for pair in all_pairs:
        by_template[pair.template].append(pair)
    train: list[Pair] = []
    held_out: list[Pair] = []
    for name, group in by_template.items():
        if name in HELD_OUT_TEMPLATES:
            held_out += group
            continue
        shuffled = rng.sample(group, len(group))
        cut = max(1, round(held_out_share * len(group)))
        held_out += shuffled[:cut]
        train += shuffled[cut:]
    rng.shuffle(train)
    rng.shuffle(held_out)
    return Split(train, held_out)


def evaluation_set(held_out: list[Pair], size: int) -> list[Pair]:
    """``size`` held-out pairs that cover the templates evenly: one of each template in turn, in
    the held-out order, until there are enough."""
    queues: defaultdict[str, list[Pair]] = defaultdict(list)
    for pair in held_out:
        queues[pair.template].append(pair)
    chosen: list[Pair] = []
    while len(chosen) < min(size, len(held_out)):
        for queue in queues.values():
            if queue and len(chosen) < size:
                chosen.append(queue.pop(0))
    return chosen


def answers_something(database: Database, sql: str) -> bool:
    rows = database.run(sql)
    return bool(rows) and rows[0][0] not in (None, 0)


def _values(database: Database, source: str | range) -> list[object]:
    return list(source) if isinstance(source, range) else database.values(source)
