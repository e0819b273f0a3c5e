"""SPO over multi-turn episodes: the environment seam (``environment``), episodes played turn by turn over
verl's ``generate`` interface with the environment's replies between the turns (``episode``), and the
Monte Carlo value of the dialogue after each turn boundary (``episode.turn_value``)."""

from spo_verl.core.episodes import arithmetic  # noqa: E402, F401  (registers the built-in environment)
