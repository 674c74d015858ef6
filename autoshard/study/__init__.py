"""The tuning study's storage side: what names a study, where its results are kept, and how
several drivers share one.

- :mod:`.settings`: the study's name, a fingerprint of everything that decides its trials;
- :mod:`.journal`: ``trials.jsonl``, the append-only record of truth;
- :mod:`.lock`: one ``autoshard tune`` per output folder;
- :mod:`.view`: what the storage knows about each candidate (attempts, running, settled);
- :mod:`.lessons`: what failed trials teach about the untried candidates;
- :mod:`.dominance`: when a measured trial makes trying a candidate pointless;
- :mod:`.loop`: the driver's loop (claim a candidate, run it, record it);
- :mod:`.driver`: one run of a study (how a candidate is tried, the order after each
  measurement, the prediction each trial is tried with);
- :mod:`.outputs`: what a study writes when it ends;
- :mod:`.storage`: the optuna storage (SQLite in the output folder, or an RDB server shared by
  several drivers), with :mod:`.database` (the URL and folder checks, one-line errors),
  :mod:`.claims` (claims, heartbeats, stale trials) and :mod:`.knobs` (what optuna-dashboard
  shows). These import optuna, only where a study runs: ``import autoshard`` does not.
"""
