"""The text-to-SQL example's task, without a server: the database and the questions are the same
for a seed and differ between seeds, every reference answers something, the split keeps held-out
questions out of training, and the reward gives 1 only for the reference's result while nothing
a model writes can change the database or run without bound."""

from __future__ import annotations

from collections import Counter

import pytest

from examples.text_to_sql import questions
from examples.text_to_sql.database import MAX_ROWS, TABLES, Database, SQLRefused
from examples.text_to_sql.reward import NO_SQL, RIGHT, WRONG, Grader, extract_sql, same_result

HEADCOUNT = (
    "SELECT COUNT(*) FROM employees JOIN departments ON employees.department_id = departments.id"
    " WHERE departments.name = 'Sales'"
)
BEST_PAID = "SELECT name FROM employees ORDER BY salary DESC LIMIT 3"


@pytest.fixture(scope="module")
def database() -> Database:
    return Database(0)


def _dump(database: Database) -> dict[str, list[tuple[object, ...]]]:
    return {table: database.run(f"SELECT * FROM {table} ORDER BY id") for table in TABLES}


def test_a_seed_always_builds_the_same_database_and_another_seed_another(
    database: Database,
) -> None:
    assert _dump(Database(0)) == _dump(database)
    assert _dump(Database(1)) != _dump(database)
    assert database.counts() == {
        "departments": 8,
        "employees": 120,
        "customers": 60,
        "products": 35,
        "orders": 300,
    }
    # Salaries and prices differ, so "the best-paid" and "the most expensive" have one answer.
    for table, column in (("employees", "salary"), ("products", "price")):
        ((distinct,),) = database.run(f"SELECT COUNT(DISTINCT {column}) FROM {table}")
        assert distinct == database.counts()[table]


def test_a_few_hundred_pairs_the_same_for_a_seed_each_reference_answering_something(
    database: Database,
) -> None:
    pairs = questions.pairs(database, seed=0)
    assert questions.pairs(Database(0), seed=0) == pairs
    assert 250 <= len(pairs) <= 400
    assert len({pair.question for pair in pairs}) == len(pairs)
    assert {pair.template for pair in pairs} == {t.name for t in questions.TEMPLATES}
    for pair in pairs:
        rows = database.run(pair.sql)
        assert rows and rows[0][0] not in (None, 0), pair
    assert max(Counter(pair.template for pair in pairs).values()) <= questions.MAX_PER_TEMPLATE


def test_the_split_holds_out_new_fillings_and_whole_templates_the_same_for_a_seed(
    database: Database,
) -> None:
    pairs = questions.pairs(database, seed=0)
    split = questions.split(pairs, seed=0)
    assert questions.split(pairs, seed=0) == split
    assert questions.split(pairs, seed=1) != split
    assert sorted(split.train + split.held_out, key=pairs.index) == pairs
    assert not {p.question for p in split.train} & {p.question for p in split.held_out}
    trained = {pair.template for pair in split.train}
    assert not trained & questions.HELD_OUT_TEMPLATES
    parts = Counter(split.part(pair) for pair in split.held_out)
    # Every trained template has held-out fillings; the held-out templates are there whole.
    assert {p.template for p in split.held_out if p.template not in questions.HELD_OUT_TEMPLATES}
    assert trained == {
        p.template for p in split.held_out if p.template not in questions.HELD_OUT_TEMPLATES
    }
    assert parts[questions.NEW_FILLINGS] > 40 and parts[questions.NEW_TEMPLATES] > 20
    assert len(split.held_out) < len(split.train) / 2

    chosen = questions.evaluation_set(split.held_out, 30)
    assert len(chosen) == 30 and len(set(chosen)) == 30 and set(chosen) <= set(split.held_out)
    # Spread over the templates: none of them has more than two of the 30.
    assert max(Counter(pair.template for pair in chosen).values()) <= 2


def test_the_reference_result_is_right_however_it_is_written(database: Database) -> None:
    grader = Grader(database)
    aliased = (
        "select count(e.id) from employees e, departments d"
        " where e.department_id = d.id and d.name = 'Sales';"
    )
    verdict = grader.grade(aliased, HEADCOUNT)
    assert (verdict.outcome, verdict.reward) == (RIGHT, 1.0)
    assert not verdict.sql.endswith(";")
    # Row order only counts when the reference orders its rows.
    shuffled = "SELECT name FROM employees WHERE hire_year = 2015 ORDER BY name DESC"
    assert grader.grade(shuffled, "SELECT name FROM employees WHERE hire_year = 2015").right
    ascending = (
        "SELECT name FROM (SELECT name, salary FROM employees ORDER BY salary DESC LIMIT 3)"
        " ORDER BY salary"
    )
    assert grader.grade(ascending, BEST_PAID).outcome == WRONG
    # AVG is a float, and an integer of the same value is the same number.
    assert same_result([(5,)], [(5.0000000001,)], in_order=True)
    assert not same_result([(1,), (1,)], [(1,)], in_order=False)  # a multiset, not a set


def test_a_wrong_result_and_malformed_sql_get_nothing(database: Database) -> None:
    grader = Grader(database)
    wrong = HEADCOUNT.replace("'Sales'", "'Legal'")
    assert (grader.grade(wrong, HEADCOUNT).outcome, grader.grade(wrong, HEADCOUNT).reward) == (
        WRONG,
        0.0,
    )
    columns = "SELECT name, salary FROM employees ORDER BY salary DESC LIMIT 3"
    assert grader.grade(columns, BEST_PAID).outcome == WRONG
    for reply, why in (
        ("SELECT COUNT(*) FROM employes", "no such table: employes"),
        ("SELECT COUNT(* FROM employees", "syntax error"),
        ("SELECT age FROM employees", "no such column: age"),
    ):
        verdict = grader.grade(reply, HEADCOUNT)
        assert verdict.reward == 0.0 and why in verdict.outcome
    assert grader.grade("I do not know.", HEADCOUNT).outcome == NO_SQL
    assert grader.grade("", HEADCOUNT).reward == 0.0


def test_the_sql_is_found_in_a_fenced_block_or_after_the_prose() -> None:
    assert extract_sql("```sql\nSELECT name\nFROM products;\n```\nThis lists...") == (
        "SELECT name\nFROM products"
    )
    assert extract_sql("To count them: SELECT COUNT(*) FROM orders; done") == (
        "SELECT COUNT(*) FROM orders"
    )
    assert extract_sql("  select 1") == "select 1"
    assert extract_sql("It is done with a query, then select it.") == ""


def test_nothing_a_model_writes_changes_the_database(database: Database) -> None:
    before = _dump(database)
    grader = Grader(database)
    for statement in (
        "DROP TABLE employees",
        "DELETE FROM orders",
        "UPDATE employees SET salary = 0",
        "INSERT INTO departments VALUES (99, 'Spies', 'Oslo')",
        "CREATE TABLE notes (x)",
        "PRAGMA query_only = OFF",
        "ATTACH DATABASE 'elsewhere.db' AS elsewhere",
    ):
        with pytest.raises(SQLRefused, match="not authorized"):
            database.run(statement)
        assert grader.grade(statement, HEADCOUNT).reward == 0.0
    with pytest.raises(SQLRefused, match="one statement"):
        database.run("SELECT 1; DROP TABLE employees")
    assert _dump(database) == before


def test_runaway_queries_are_stopped(database: Database) -> None:
    with pytest.raises(SQLRefused, match="stopped after"):
        database.run("SELECT COUNT(*) FROM orders a, orders b, orders c")
    with pytest.raises(SQLRefused, match="stopped after"):
        database.run(
            "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n) SELECT SUM(x) FROM n"
        )
    with pytest.raises(SQLRefused, match=f"more than {MAX_ROWS} rows"):
        database.run("SELECT a.id FROM orders a, orders b")
    with pytest.raises(SQLRefused, match="too big"):
        database.run("SELECT randomblob(10000000)")
    # And the next statement runs as usual.
    assert database.run("SELECT COUNT(*) FROM orders") == [(300,)]
