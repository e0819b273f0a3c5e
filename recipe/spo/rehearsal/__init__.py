"""The rehearsal of a cluster setting through verl's real trainer on the CPU (``scripts/rehearse.sh``): the
setting as shipped, with only what this hardware forces changed, each change declared with its reason
(:mod:`.substitutions`), on a tiny model of the setting's architecture and prompt format and on problems
prepared by the project's own data preparation (:mod:`.build`)."""
