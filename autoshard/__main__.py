"""``python -m autoshard``."""

from autoshard.cli import main

main()
