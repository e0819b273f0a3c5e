"""verl's plugin entry point: importing it installs SPO's names in verl
(``spo_verl.adapters.registration.install``: estimators, loss, agent loops, stop strings, the recipe's
OmegaConf resolvers and, with ``VERL_PLATFORM=spo_cpu``, the CPU platform).

Loaded in every process that imports verl through the ``verl.plugins`` entry point (``pyproject.toml``),
or through ``VERL_USE_EXTERNAL_MODULES=spo_verl.register`` / ``actor_rollout_ref.model.external_lib=spo_verl.register``.
"""

from spo_verl.adapters.registration import install

install()
