"""A parallel hyperparameter sweep with successive halving, through the plain Tinker SDK.

It tunes the pig-latin LoRA fine-tune of ``examples/sft_pig_latin.py`` (whose task, data and
chat format it imports): N runs, each its own ``TrainingClient`` with its own learning rate, LoRA
rank and loss, train side by side, concurrently (asyncio, every run's next step always queued on
the trainer). After each rung of steps every run is scored on the held-out words, the better half
goes on, and each rung is twice as long as the one before, until one run is left::

    4 runs x 8 steps -> the best 2 x 16 more steps -> the winner (24 steps)

The score that decides is the held-out NLL per answer token (a forward pass: cheap, and smooth
enough to rank runs after a few steps); the exact-match accuracy of the greedy translations is
measured beside it on the sampler, while the trainer goes on with the next rung. Every run is
tagged with the sweep (its ``user_metadata`` ``sweep``), both scores are reported to it
(``POST /api/v1/training_runs/{id}/metrics``), so the console's sweep page shows the sweep live.
At the end: a table of every run, a plot, the engines' busy share over the sweep
(``GET /api/v1/engines``, which needs an admin key) and the console URL of the sweep.

Run from the repository root. With no ``--url`` it starts a private ``tinsmith up`` (as
``make demo`` does), issues itself an admin key there, and stops it at the end: about three
minutes on two CPU cores with SmolLM2-135M-Instruct, in which the winner gets its first exact
translations (``--rung-steps 3``: a minute and a half, and the held-out NLL alone shows it
learning)::

    python -m examples.autoresearch
    TINKER_API_KEY=tml-anything python -m examples.autoresearch --url http://127.0.0.1:8000 \\
        --runs 8 --rung-steps 3 --batch 8 --admin-key "$ADMIN_KEY"

Modules: ``sweep`` (the runs, their training, scoring and halving), ``report`` (the table and
the plot), ``__main__`` (the command line and the private tinsmith); the two tinsmith REST routes
beside the SDK are ``examples.rest``, which ``examples.text_to_sql`` uses too.
"""
