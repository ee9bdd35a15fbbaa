"""Text-to-SQL with RL through the plain Tinker SDK, on a SQLite database it builds itself.

A model learns to answer questions about a small database with SQL, rewarded by running its SQL
and comparing the result with the reference's.

Everything is made here, from a seed, with no download: the database (a small company:
departments, employees, customers, products, orders; ``database``), a few hundred question/SQL
pairs from templates, split into questions to train on and held-out ones (new fillings of the
trained templates, and whole templates never trained on; ``questions``), and the reward (1 if
the model's SQL, run read-only with bounded work, returns the reference's rows, else 0;
``reward``). The training (``loop``) is one LoRA run:

1. the held-out questions, answered greedily by the base model: its execution accuracy;
2. a short SFT warm start (cross_entropy on the training questions' reference SQL), because the
   base model does not write SQL for this schema at all; the held-out accuracy again;
3. RL on the training questions: for each batch, a group of answers per question sampled from
   the current weights, each rewarded by running it, group-centred advantages, an
   ``importance_sampling`` (or ``ppo``) step with the sampler's logprobs, then new sampler
   weights; the held-out accuracy once more.

It prints the held-out questions with the model's SQL after each evaluation, as ``make demo``
prints its translations, a progress bar, and at the end the accuracies side by side and the
reward curve; the rewards and accuracies also go to the run's metrics
(``POST /api/v1/training_runs/{id}/metrics``), so the console's run page draws them.

Run from the repository root. With no ``--url`` it starts a private ``tinsmith up`` and stops it
at the end (about ten minutes on two CPU cores with SmolLM2-135M-Instruct); ``--gpu`` is the
larger configuration for a GPU::

    python -m examples.text_to_sql
    TINKER_API_KEY=tml-anything python -m examples.text_to_sql --url http://127.0.0.1:8000 --gpu

Modules: ``database``, ``questions``, ``reward`` (the task), ``loop`` (the training), ``report``
(the tables), ``__main__`` (the command line and the private tinsmith).
"""
