"""The tuning study's storage side: what names a study, where its results are kept, and how
several drivers share one.

- :mod:`.settings`: the study's name, a fingerprint of everything that decides its trials;
- :mod:`.journal`: ``trials.jsonl``, the append-only record of truth;
- :mod:`.lock`: one ``autoshard tune`` per output folder;
- :mod:`.view`: what the storage knows about each candidate (attempts, running, settled);
- :mod:`.lessons`: what failed trials teach about the untried candidates;
- :mod:`.loop`: the driver's loop (claim a candidate, run it, record it);
- :mod:`.storage`: the optuna storage (SQLite in the output folder, or an RDB server shared by
  several drivers). The only module of this package that imports optuna: ``import autoshard``
  does not.
"""
